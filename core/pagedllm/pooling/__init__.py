"""The pooling runner's pieces (vLLM's pooling models): the pooler config, sentence-transformers config reading,
the resolved per-engine spec, and the poolers that turn hidden states into embeddings, class probabilities,
scores and rewards. docs/pooling.md."""

from pagedllm.pooling.config import POOLING_TYPES, PoolerConfig
from pagedllm.pooling.pooler import Pooler, PoolingState, activation, classifier_of
from pagedllm.pooling.spec import CONVERTS, RUNNERS, PoolingSpec, check_request, resolve_pooling, runner_type
from pagedllm.pooling.st_config import SentenceTransformersConfig, read_sentence_transformers_config

__all__ = ["CONVERTS", "POOLING_TYPES", "RUNNERS", "PoolerConfig", "Pooler", "PoolingSpec", "PoolingState",
           "SentenceTransformersConfig", "activation", "check_request", "classifier_of",
           "read_sentence_transformers_config", "resolve_pooling", "runner_type"]
