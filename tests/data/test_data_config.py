import pytest

from moetrain.data import DataConfig


def test_defaults_validate():
    cfg = DataConfig()
    assert cfg.validate() is cfg
    assert cfg.paths == [] and cfg.vocab_size == 4096 and cfg.seq_len == 256 and cfg.text_field == "text"


@pytest.mark.parametrize("field,value,fragment", [
    ("seq_len", 1, ">= 2"),
    ("val_fraction", 0.0, "(0, 0.5]"),
    ("val_fraction", 0.6, "(0, 0.5]"),
    ("vocab_size", 256, "[257"),
    ("vocab_size", True, "[257"),
    ("paths", "data.txt", "list"),
    ("paths", [""], "non-empty"),
    ("text_field", "", "non-empty"),
    ("tokenizer", "", "tokenizer.json"),
    ("cache_dir", "", "directory"),
    ("builtin_max_bytes", 0, ">= 1"),
    ("seed", -1, ">= 0"),
    ("eos_token", "", "token"),
])
def test_validate_names_field_and_allowed_values(field, value, fragment):
    cfg = DataConfig(**{field: value})
    with pytest.raises(ValueError) as ei:
        cfg.validate()
    msg = str(ei.value)
    assert f"data.{field}" in msg and f"--set data.{field}=" in msg and fragment in msg and repr(value) in msg
