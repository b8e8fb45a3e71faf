"""Model configuration: YAML loading, field-path errors, overrides, hashing, field descriptions."""
import dataclasses
import math
import shutil
import typing
from pathlib import Path

import pytest
import yaml

from synflux_ros.core.config import (
    ConfigError,
    LLMConfig,
    ModelConfig,
    describe_fields,
    from_dict,
    load_config,
)

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
YAMLS = sorted(CONFIG_DIR.glob("*.yaml"))


def raw(name: str) -> dict:
    with open(CONFIG_DIR / name, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def bad(data: dict, source: str = "") -> str:
    with pytest.raises(ConfigError) as info:
        from_dict(data, source=source)
    return str(info.value)


# ------------------------------------------------------------------ loading

def test_config_dir_has_the_shipped_models():
    names = {p.name for p in YAMLS}
    assert {"vla_demo_orin.yaml", "vla_openvla.yaml", "vla_pi0.yaml", "vlm_demo.yaml",
            "vlm_qwen3.yaml"} <= names


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_every_yaml_loads(path):
    cfg = load_config(str(path))
    assert isinstance(cfg, ModelConfig)
    assert cfg.source == str(path.resolve())
    assert cfg.mode in ("vla", "vlm")
    assert cfg.llm.decode_buckets[-1] == cfg.llm.max_seq_len
    if cfg.mode == "vla":
        assert cfg.action is not None
        assert cfg.vision.num_tokens < cfg.llm.max_seq_len


def test_loaded_values_and_derived_fields():
    cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
    assert cfg.vision.resolution == (448, 448)
    assert cfg.vision.num_tiles == 4
    assert cfg.vision.num_tokens == 64
    assert cfg.llm.prefill_buckets == (96, 160)
    assert cfg.llm.kv_shape == (2, 2, 2, 256, 16)
    assert cfg.action.head_type == "flow_matching"

    vlm = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    assert vlm.action is None
    assert vlm.text.do_sample is False
    assert vlm.session.max_sessions == 4


def test_head_dim_and_kv_heads_defaults():
    llm = LLMConfig(num_layers=1, hidden_dim=64, num_heads=8, vocab_size=300, prefill_buckets=(8,),
                    decode_buckets=(16,), max_seq_len=16)
    assert llm.num_kv_heads == 8
    assert llm.head_dim == 8


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    p = tmp_path / "broken.yaml"
    p.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(p))
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(p))


# ------------------------------------------------------------------ field-path errors

def test_unknown_field_suggests_the_close_name():
    d = raw("vlm_demo.yaml")
    d["llm"]["num_layerz"] = d["llm"].pop("num_layers")
    msg = bad(d, source="/x/vlm_demo.yaml")
    assert msg.startswith("vlm_demo.yaml: ")
    assert "llm.num_layerz: unknown field" in msg
    assert "did you mean 'num_layers'?" in msg


def test_unknown_top_level_field_without_close_match_lists_known_fields():
    d = raw("vlm_demo.yaml")
    d["zzzzqqq"] = 1
    msg = bad(d)
    assert "zzzzqqq: unknown field" in msg
    assert "choices:" in msg and "llm" in msg and "session" in msg


def test_bad_choice_lists_the_choices():
    d = raw("vla_pi0.yaml")
    d["action"]["head_type"] = "flow"
    msg = bad(d, source="vla_pi0.yaml")
    assert "action.head_type" in msg
    assert "'flow' is not allowed" in msg
    assert "flow_matching" in msg and "autoregressive" in msg


@pytest.mark.parametrize("section,key,value,path", [
    ("llm", "num_layers", 0, "llm.num_layers"),
    ("session", "max_sessions", 0, "session.max_sessions"),
    ("text", "max_new_tokens", -3, "text.max_new_tokens"),
])
def test_below_minimum(section, key, value, path):
    d = raw("vlm_demo.yaml")
    d[section][key] = value
    msg = bad(d)
    assert path in msg
    assert "below the minimum" in msg


def test_above_maximum():
    d = raw("vlm_demo.yaml")
    d["text"]["top_p"] = 1.5
    msg = bad(d)
    assert "text.top_p" in msg and "above the maximum 1.0" in msg


def test_minimum_applies_to_tuple_items():
    d = raw("vlm_demo.yaml")
    d["vision"]["resolution"] = [224, 0]
    msg = bad(d)
    assert "vision.resolution[1]" in msg and "below the minimum" in msg


@pytest.mark.parametrize("section,key,value,path,expect", [
    ("llm", "num_layers", "2", "llm.num_layers", "expected an integer"),
    ("llm", "num_layers", 2.5, "llm.num_layers", "expected an integer"),
    ("llm", "num_layers", True, "llm.num_layers", "expected an integer"),
    ("session", "reuse_kv_cache", "yes", "session.reuse_kv_cache", "expected true or false"),
    ("text", "temperature", "hot", "text.temperature", "expected a number"),
    ("llm", "prefill_buckets", 32, "llm.prefill_buckets", "expected a list"),
    ("vision", "resolution", [224, 224, 3], "vision.resolution", "expected 2 values"),
    ("executor", "backend", 5, "executor.backend", "expected a string"),
])
def test_wrong_type(section, key, value, path, expect):
    d = raw("vlm_demo.yaml")
    d[section][key] = value
    msg = bad(d)
    assert path in msg
    assert expect in msg


def test_section_must_be_a_mapping():
    d = raw("vlm_demo.yaml")
    d["llm"] = [1, 2]
    assert "llm: expected a mapping" in bad(d)


def test_int_is_accepted_for_float_fields():
    d = raw("vlm_demo.yaml")
    d["text"]["temperature"] = 1
    cfg = from_dict(d)
    assert cfg.text.temperature == 1.0 and isinstance(cfg.text.temperature, float)


def test_tile_must_divide_resolution():
    d = raw("vla_demo_orin.yaml")
    d["vision"]["tile_size"] = [224, 200]
    msg = bad(d)
    assert "vision.tile_size" in msg
    assert "200" in msg and "width" in msg


def test_missing_required_field():
    d = raw("vlm_demo.yaml")
    del d["llm"]["vocab_size"]
    assert "llm.vocab_size: required field is missing" in bad(d)
    d = raw("vlm_demo.yaml")
    del d["name"]
    assert "name: required field is missing" in bad(d)
    d = raw("vla_pi0.yaml")
    del d["action"]
    assert "action: required when mode is 'vla'" in bad(d)


def test_decode_buckets_must_end_at_max_seq_len():
    d = raw("vlm_demo.yaml")
    d["llm"]["decode_buckets"] = [256, 512]
    msg = bad(d)
    assert "llm.decode_buckets" in msg and "max_seq_len" in msg and "1024" in msg


@pytest.mark.parametrize("buckets", [[128, 32], [32, 32, 128]])
def test_buckets_must_be_strictly_increasing(buckets):
    d = raw("vlm_demo.yaml")
    d["llm"]["prefill_buckets"] = buckets
    msg = bad(d)
    assert "llm.prefill_buckets" in msg and "strictly increasing" in msg


def test_empty_and_oversized_buckets():
    d = raw("vlm_demo.yaml")
    d["llm"]["prefill_buckets"] = []
    assert "at least one bucket" in bad(d)
    d = raw("vlm_demo.yaml")
    d["llm"]["prefill_buckets"] = [32, 2048]
    assert "exceeds max_seq_len" in bad(d)


def test_cross_field_checks():
    d = raw("vlm_demo.yaml")
    d["llm"]["num_kv_heads"] = 3
    assert "llm.num_kv_heads" in bad(d)

    d = raw("vla_openvla.yaml")
    d["action"]["norm_q01"] = d["action"]["norm_q01"][:3]
    assert "action.norm_q01: 3 values given" in bad(d)

    d = raw("vla_openvla.yaml")
    del d["action"]["norm_q99"]
    assert "give both or neither" in bad(d)

    d = raw("vla_openvla.yaml")
    d["action"]["token_vocab_size"] = 40000
    assert "action.token_vocab_size" in bad(d)

    d = raw("vla_demo_orin.yaml")
    d["llm"]["max_seq_len"] = 64
    d["llm"]["prefill_buckets"] = [32]
    d["llm"]["decode_buckets"] = [64]
    assert "leaves no room" in bad(d)

    d = raw("vlm_demo.yaml")
    d["vision"]["std"] = [0.5, 0.0, 0.5]
    assert "vision.std" in bad(d)


@pytest.mark.parametrize("llm,needle", [
    ({"sliding_window": 8}, "llm.sliding_window: the window and sliding_window_layers go together"),
    ({"sliding_window_layers": [0]}, "llm.sliding_window: the window and sliding_window_layers go together"),
    ({"sliding_window": 8, "sliding_window_layers": [1, 0]}, "strictly increasing layer indices below num_layers"),
    ({"sliding_window": 8, "sliding_window_layers": [0, 99]}, "strictly increasing layer indices below num_layers"),
    ({"rope_local_theta": 10.0}, "llm.rope_local_theta: a rope base for sliding-window layers, but there are none"),
    ({"attn_logit_softcapping": -1.0}, "llm.attn_logit_softcapping"),
])
def test_sliding_window_and_gemma_fields_are_checked(llm, needle):
    d = raw("vlm_demo.yaml")
    d["llm"].update(llm)
    assert needle in bad(d)


def test_a_flow_head_refuses_a_backbone_its_expert_cannot_mirror():
    d = raw("vla_demo_orin.yaml")
    d["llm"]["architecture"] = "gemma2"
    assert "llm.architecture: gemma2: the action expert of a flow-matching head" in bad(d)
    for field, value in (("attn_logit_softcapping", 50.0), ("query_pre_attn_scalar", 256.0)):
        d = raw("vla_demo_orin.yaml")
        d["llm"][field] = value
        assert f"llm.{field}: a decoder feature the action expert of a flow-matching head does not have" in bad(d)
    d = raw("vla_openvla.yaml")  # action tokens, but a bidirectional prefix: the window is causal only
    d["llm"].update(sliding_window=8, sliding_window_layers=[0], prefill_attention="bidirectional")
    assert "llm.sliding_window: the window is causal" in bad(d)
    d = raw("vlm_demo.yaml")
    d["llm"].update(architecture="gemma3", sliding_window=4, sliding_window_layers=[0])
    assert from_dict(d).llm.sliding_window_layers == (0,)


def test_nan_is_rejected_for_bounded_fields():
    d = raw("vlm_demo.yaml")
    d["text"]["temperature"] = math.nan
    with pytest.raises(ConfigError, match="text.temperature"):
        from_dict(d)


# ------------------------------------------------------------------ overrides, hash, describe

def test_with_overrides_merges_sections_and_validates():
    cfg = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    new = cfg.with_overrides(session={"max_sessions": 1}, executor={"latency_ms": {"prefill": 5}})
    assert new.session.max_sessions == 1
    assert new.session.eviction == cfg.session.eviction  # other keys kept
    assert new.executor.latency_ms == {"prefill": 5.0}
    assert new.source == cfg.source
    assert cfg.session.max_sessions == 4  # original untouched
    assert new.llm == cfg.llm

    renamed = cfg.with_overrides(name="other")
    assert renamed.name == "other"

    with pytest.raises(ConfigError, match="session.max_sessions"):
        cfg.with_overrides(session={"max_sessions": 0})
    with pytest.raises(ConfigError, match="session.max_sesions: unknown field"):
        cfg.with_overrides(session={"max_sesions": 2})


def test_with_overrides_round_trips_every_shipped_config():
    for path in YAMLS:
        cfg = load_config(str(path))
        again = cfg.with_overrides()
        assert again == cfg


def test_hash_is_stable_and_ignores_the_file_name(tmp_path):
    path = CONFIG_DIR / "vla_demo_orin.yaml"
    a = load_config(str(path))
    b = load_config(str(path))
    copy_path = tmp_path / "renamed.yaml"
    shutil.copy(path, copy_path)
    c = load_config(str(copy_path))
    assert len(a.hash()) == 16
    assert a.hash() == b.hash() == c.hash()
    assert a.with_overrides().hash() == a.hash()


def test_hash_changes_when_a_shape_changes():
    cfg = load_config(str(CONFIG_DIR / "vla_demo_orin.yaml"))
    h = cfg.hash()
    assert cfg.with_overrides(llm={"prefill_buckets": [64, 160]}).hash() != h
    assert cfg.with_overrides(llm={"hidden_dim": 128, "head_dim": 32}).hash() != h
    assert cfg.with_overrides(vision={"tokens_per_tile": 8}).hash() != h
    assert cfg.with_overrides(action={"action_horizon": 8}).hash() != h
    assert cfg.with_overrides(llm={"kv_dtype": "float16"}).hash() != h
    hashes = {load_config(str(p)).hash() for p in YAMLS}
    assert len(hashes) == len(YAMLS)


def test_to_dict_excludes_source_and_is_yaml_compatible():
    cfg = load_config(str(CONFIG_DIR / "vla_openvla.yaml"))
    d = cfg.to_dict()
    assert "source" not in d
    again = from_dict(yaml.safe_load(yaml.safe_dump(_listify(d))))
    assert again.hash() == cfg.hash()


def _listify(v):
    if isinstance(v, dict):
        return {k: _listify(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_listify(x) for x in v]
    return v


def test_describe_fields():
    lines = describe_fields()
    assert lines and all(isinstance(line, str) for line in lines)
    by_path = {line.split(" ", 1)[0]: line for line in lines}
    assert "source" not in by_path
    assert "llm.num_layers" in by_path and "required" in by_path["llm.num_layers"]
    assert "min 1" in by_path["llm.num_layers"]
    assert "choices: flow_matching, autoregressive" in by_path["action.head_type"]
    assert "max 1.0" in by_path["text.top_p"]
    assert by_path["session.max_sessions"].endswith("concurrent chat sessions")
    # One line per leaf field of every section (sections inside sections, e.g. action.state_norm, expanded).
    def leaves(cls) -> int:
        n = 0
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "source":
                continue
            tp = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
            n += leaves(tp[0]) if dataclasses.is_dataclass(tp[0]) else 1
        return n
    n_leaves = leaves(ModelConfig)
    assert "action.state_norm.mode" in by_path and "action.action_norm.eps" in by_path
    assert len(lines) == n_leaves
