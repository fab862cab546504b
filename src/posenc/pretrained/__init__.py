"""Trained checkpoints that install offline: the catalog and the fetcher (:mod:`.catalog`), the
conversion and loading into transformers (:mod:`.loading`). ``posenc.pretrained`` hands on the public names.
"""

from .loading import (
    MODELS,
    MODELS_ENV,
    WEIGHT_FILES,
    Piece,
    PretrainedModel,
    causal_lm_class_name,
    check_causal_decoder,
    convert,
    converted_dir,
    fetch,
    fetch_command,
    load,
    load_config,
    model_path,
    models_dir,
    reference_text,
)

__all__ = [
    "MODELS",
    "MODELS_ENV",
    "WEIGHT_FILES",
    "Piece",
    "PretrainedModel",
    "causal_lm_class_name",
    "check_causal_decoder",
    "convert",
    "converted_dir",
    "fetch",
    "fetch_command",
    "load",
    "load_config",
    "model_path",
    "models_dir",
    "reference_text",
]
