"""Model configuration: one YAML file per model, loaded into validated dataclasses.

The package's parts: ``schema`` (``setting``, the field declaration every section uses, and the loader that
checks a mapping against it), ``backbone`` (vision, llm, tokenizer), ``heads`` (action, text), ``execution``
(the execution section and its limits, validate and rtc), ``service`` (executor, pipeline, session, remote,
serve) and ``model`` (``ModelConfig``, the whole file, and ``load_config``). Import from the package.
"""
from .backbone import (DEFAULT_MAX_INPUT_PIXELS, DTYPES, TOKEN_ID_DTYPES, LLMConfig, PreprocessSpec,
                       TokenizerConfig, VisionConfig)
from .execution import (EXECUTION_MODES, GUIDED_MODES, ChunkValidation, ExecutionConfig, LimitsConfig,
                        RTCConfig)
from .heads import ActionConfig, NormalizationConfig, TextConfig
from .model import ModelConfig, describe_fields, from_dict, load_config
from .schema import ConfigError, choices_hint, graph_values, options_from_dict, setting
from .service import (PROXY_WS_MAX_BYTES, ExecutorConfig, PipelineConfig, Placement, RemoteConfig, ServeConfig,
                      SessionConfig)

__all__ = [
    "DEFAULT_MAX_INPUT_PIXELS", "DTYPES", "EXECUTION_MODES", "GUIDED_MODES", "PROXY_WS_MAX_BYTES",
    "TOKEN_ID_DTYPES", "ActionConfig", "ChunkValidation", "ConfigError", "ExecutionConfig", "ExecutorConfig",
    "LLMConfig", "LimitsConfig", "ModelConfig", "NormalizationConfig", "PipelineConfig", "Placement",
    "PreprocessSpec", "RTCConfig", "RemoteConfig", "ServeConfig", "SessionConfig", "TextConfig",
    "TokenizerConfig", "VisionConfig", "choices_hint", "describe_fields", "from_dict", "graph_values",
    "load_config", "options_from_dict", "setting",
]
