"""pagedllm backend for Huawei Ascend NPUs (distribution ``pagedllm-ascend``); the hooks live in
:mod:`pagedllm_ascend.plugin`. Importing this package imports no vendor module (torch-npu loads on first use).

Not verified on hardware: written against torch-npu's API as vllm-ascend calls it, tested on a simulated device.
"""
