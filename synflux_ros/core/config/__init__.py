"""Model configuration: one YAML file per model, loaded into validated dataclasses (see ``model.py``)."""
from .model import (  # noqa: F401
    DEFAULT_MAX_INPUT_PIXELS, DTYPES, EXECUTION_MODES, GUIDED_MODES, PROXY_WS_MAX_BYTES, TOKEN_ID_DTYPES,
    ActionConfig, ChunkValidation, ConfigError, ExecutionConfig, ExecutorConfig, LimitsConfig, LLMConfig,
    ModelConfig, NormalizationConfig, PipelineConfig, Placement, PreprocessSpec, RemoteConfig, RTCConfig,
    ServeConfig, SessionConfig, TextConfig, TokenizerConfig, VisionConfig, _spec, choices_hint, describe_fields,
    from_dict, load_config, options_from_dict,
)
