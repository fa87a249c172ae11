"""``PoolingSpec``: what one pooling engine runs, resolved once at start-up from ``runner`` / ``convert`` /
``pooler_config``, the architecture and the checkpoint's sentence-transformers files (vLLM's model-config rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedllm.errors import ParamError
from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.st_config import read_sentence_transformers_config

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")


@dataclass(frozen=True)
class PoolingSpec:
    architecture: str
    convert: str  # embed | classify | reward: what the model was turned into
    tasks: tuple[str, ...]  # the tasks requests may ask for
    default_task: str
    pooling_type: str  # embed's
    classify_pooling_type: str  # classify / score's (LAST: HF's *ForSequenceClassification)
    normalize: bool  # embed's default
    dimensions: Optional[int]  # embed's default dimensions
    use_activation: bool
    hidden_size: int
    num_labels: Optional[int]  # None: no classifier
    matryoshka_dimensions: Optional[tuple[int, ...]] = None


def is_pooling_architecture(architecture: str) -> bool:
    """Architectures that only pool (vLLM's runner "auto" picks the pooling runner for them)."""
    if architecture.endswith("LMHeadModel"):  # GPT2LMHeadModel & co generate
        return False
    return architecture.endswith(("ForSequenceClassification", "Model", "ForTextEmbedding"))


def runner_type(runner: str, convert: str, architecture: str) -> str:
    """``generate`` or ``pooling``: an explicit runner, else pooling when converting or for a pooling architecture."""
    if runner != "auto":
        return runner
    if convert not in ("auto", "none") or is_pooling_architecture(architecture):
        return "pooling"
    return "generate"


def resolve_pooling(config: Any, model_path: str, architecture: str, hidden_size: int,
                    num_labels: Optional[int], default_pooling_type: str = "LAST") -> PoolingSpec:
    """The pooling spec of a ``runner="pooling"`` engine (``config``: its resolved EngineConfig); ``num_labels``:
    the loaded model's classifier width (None: it has no classifier); ``default_pooling_type``: the model's own
    (a decoder's LAST; BERT-style encoders' CLS, which their classification heads read too)."""
    pc = PoolerConfig.parse(config.pooler_config) or PoolerConfig()
    convert = config.convert
    if convert in ("auto", "none"):
        convert = "classify" if num_labels is not None else "embed"
    if convert == "classify" and num_labels is None:
        raise ParamError("convert", f"{architecture} at {model_path} has no classification head: a "
                                    "*ForSequenceClassification checkpoint (score.weight) or hf_overrides "
                                    "classifier_from_token is needed for --convert classify")
    st = read_sentence_transformers_config(model_path)
    pooling_type = pc.pooling_type or (st.pooling_type if st is not None else None) or default_pooling_type
    if pooling_type == "ALL" and convert != "reward":
        raise ParamError("pooler_config.pooling_type", f"ALL pools every token: it serves --convert reward and the "
                                                       f"encode task, not {convert}")
    normalize = pc.normalize if pc.normalize is not None else (st.normalize if st is not None else True)
    if pc.dimensions is not None and pc.dimensions > hidden_size:
        raise ParamError("pooler_config.dimensions", f"{pc.dimensions} exceeds the hidden size {hidden_size}")
    if convert == "embed":
        tasks: tuple[str, ...] = ("embed", "encode")
    elif convert == "classify":
        tasks = ("classify",) + (("score",) if num_labels == 1 else ()) + ("reward", "encode")
    else:
        tasks = ("reward", "encode")
    return PoolingSpec(architecture, convert, tasks, tasks[0], pooling_type,
                       pc.pooling_type if pc.pooling_type not in (None, "ALL") else default_pooling_type,
                       bool(normalize),
                       pc.dimensions, pc.use_activation if pc.use_activation is not None else True, hidden_size,
                       num_labels, tuple(pc.matryoshka_dimensions) if pc.matryoshka_dimensions else None)


def check_request(spec: PoolingSpec, params: Any, model: str) -> Any:
    """``params`` (PoolingParams) verified for this model: its task (default: the model's), dimensions in range,
    every default filled from the spec. Raises ParamError naming the field."""
    task = params.task or spec.default_task
    if task not in spec.tasks:
        why = (f"; score needs a one-label classifier ({spec.num_labels} labels here)"
               if task == "score" and spec.num_labels else "")
        raise ParamError("task", f"model {model} ({spec.architecture}, --convert {spec.convert}) supports "
                                 f"{', '.join(spec.tasks)}, not {task!r}{why}")
    if task == "embed":
        dims = params.dimensions if params.dimensions is not None else spec.dimensions
        if dims is not None:
            if dims > spec.hidden_size:
                raise ParamError("dimensions", f"{dims} exceeds the model's hidden size {spec.hidden_size}")
            if spec.matryoshka_dimensions and dims not in spec.matryoshka_dimensions:
                raise ParamError("dimensions", f"model {model} supports Matryoshka dimensions "
                                               f"{list(spec.matryoshka_dimensions)}, not {dims}")
        params = params.clone(dimensions=dims,
                              normalize=params.normalize if params.normalize is not None else spec.normalize)
    elif task in ("classify", "score", "reward") and params.use_activation is None:
        params = params.clone(use_activation=spec.use_activation)
    return params.verify(task)
