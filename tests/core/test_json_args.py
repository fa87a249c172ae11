"""The engine's JSON-object arguments parse one way (pagedllm/json_args.py): for pooler_config, speculative_config,
structured_outputs_config and kv_transfer_config alike, JSON text that does not parse, a value that is not an object
and an unknown key are each refused with a ParamError naming the field (or the key under it) and saying why; a dict
and its JSON text give the same config."""

from __future__ import annotations

import json

import pytest

from pagedllm.errors import ParamError
from pagedllm.kv_transfer.config import KVTransferConfig
from pagedllm.pooling.config import PoolerConfig
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.limits import StructuredOutputsConfig

CONFIGS = {"pooler_config": (PoolerConfig, {"pooling_type": "CLS", "normalize": False}),
           "speculative_config": (SpeculativeConfig, {"method": "ngram", "num_speculative_tokens": 3}),
           "structured_outputs_config": (StructuredOutputsConfig, {"max_choices": 7}),
           "kv_transfer_config": (KVTransferConfig, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"})}


@pytest.mark.parametrize("field", CONFIGS)
def test_each_json_argument_is_refused_the_same_way(field):
    cls, good = CONFIGS[field]
    assert cls.parse(good) == cls.parse(json.dumps(good))
    for bad, where, why in (("{nope", field, "is not valid JSON: "),
                            ("[1, 2]", field, "must be a JSON object, got list"),
                            ({**good, "typo": 1}, f"{field}.typo", "unknown key; known: ")):
        with pytest.raises(ParamError) as e:
            cls.parse(bad)
        assert e.value.field == where and e.value.message.startswith(why), (bad, str(e.value))
    with pytest.raises(ParamError) as e:  # the known keys are listed, sorted
        cls.parse({"zz": 1})
    known = e.value.message.removeprefix("unknown key; known: ").split(", ")
    assert known == sorted(known) and set(good) <= set(known)
