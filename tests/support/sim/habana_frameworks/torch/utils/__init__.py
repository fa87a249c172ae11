from habana_frameworks.torch.utils import internal  # noqa: F401
