"""The state-dict adapter interface, re-exported from its home :mod:`moetrain.model.state_dict` (the model families'
adapters sit beside their models and import it there)."""

from moetrain.model.state_dict import (  # noqa: F401 - re-exported
    Box,
    StackedEntry,
    StateDictAdapter,
    StateMap,
    TensorEntry,
    indexed,
    training_fields,
)
