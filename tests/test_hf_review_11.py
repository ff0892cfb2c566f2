"""Review 11, the transformers test helpers: ``tiny_config`` set every ``TINY`` field a config
has, and a config whose field is a read-only property (Falcon's ``head_dim``, derived from
``hidden_size`` and the heads) raised ``AttributeError``, so a family sweep could not even
build the model to see it refused."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from attnhub import Hub
from attnhub.errors import InputError
from attnhub.integrations import transformers as hf
from attnhub.integrations.transformers.testing import TINY, tiny_config
from attnhub.policy import load_policy


@pytest.mark.parametrize("model_type", ["falcon", "llama"])
def test_tiny_config_skips_read_only_fields_and_keeps_the_rest(model_type: str) -> None:
    cfg = tiny_config(model_type)
    assert cfg.hidden_size == TINY["hidden_size"]
    assert cfg.num_attention_heads == TINY["num_attention_heads"]
    # the derived field follows the sizes that were set (a property cannot be set)
    assert cfg.hidden_size // cfg.num_attention_heads == TINY["head_dim"]


def test_a_tiny_falcon_is_refused_with_the_reason_not_an_attribute_error() -> None:
    hf.register(Hub(policy=load_policy()))
    with pytest.raises(InputError, match="FalconForCausalLM cannot use"):
        transformers.AutoModelForCausalLM.from_config(tiny_config("falcon"),
                                                      attn_implementation="attnhub")
