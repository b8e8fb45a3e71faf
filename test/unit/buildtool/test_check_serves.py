"""synflux-build refuses, before exporting anything, a chat config that vlm_node would refuse at start with the
tokenizer and chat template the graph set ships (``export.check_serves``, the runtime's ``check_chat_setup``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers")

from synflux_ros.graphkit.builder import BuildError  # noqa: E402
from synflux_ros.buildtool.export import build, check_serves  # noqa: E402
from synflux_ros.core.config import ConfigError, load_config  # noqa: E402
from synflux_ros.model.chat_template import CHATML  # noqa: E402
from synflux_ros.model.tokenizer import load_tokenizer  # noqa: E402
from synflux_ros.runtimes.vlm import chat_template_of, check_chat_setup  # noqa: E402

from checkpoints import demo_size, write_tokenizer  # noqa: E402

CONFIG = Path(__file__).resolve().parents[3] / "config"
TEXT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def config(tmp_path, name: str, **tokenizer):
    """``config/<name>.yaml`` at demo size, its tokenizer a small BPE with the chat specials in tmp_path/tok."""
    raw = demo_size(yaml.safe_load((CONFIG / f"{name}.yaml").read_text()))
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    write_tokenizer(str(tok))
    raw["tokenizer"] = {**(raw.get("tokenizer") or {}), "path": str(tok / "tokenizer.json"), **tokenizer}
    raw["llm"]["vocab_size"] = max(raw["llm"]["vocab_size"], 512)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path))


def test_a_vision_config_whose_template_places_no_images_is_refused_before_export(tmp_path):
    (tmp_path / "text.jinja").write_text(TEXT_TEMPLATE)
    cfg = config(tmp_path, "vlm_qwen3", chat_template=str(tmp_path / "text.jinja"))
    with pytest.raises(BuildError, match=r"vlm_node would refuse this graph set at start: the chat template "
                                         r"\(.*text\.jinja\) does not place images"):
        build(cfg, str(tmp_path / "graphs"))
    assert not os.path.exists(tmp_path / "graphs" / "manifest.json")  # nothing was exported
    # the runtime's own check says the same
    tok = load_tokenizer(cfg)
    with pytest.raises(ConfigError, match="does not place images"):
        check_chat_setup(cfg, tok, chat_template_of(cfg, tok))


def test_a_vision_config_whose_tokenizer_lacks_the_image_token_is_refused(tmp_path):
    cfg = config(tmp_path, "vlm_qwen3", image_token="<|image|>")
    with pytest.raises(BuildError, match=r"tokenizer.image_token: '<\|image\|>' is not a token of the tokenizer"):
        check_serves(cfg, None)


def test_what_the_node_takes_passes(tmp_path):
    (tmp_path / "chatml.jinja").write_text(CHATML)
    check_serves(config(tmp_path, "vlm_qwen3", chat_template=str(tmp_path / "chatml.jinja")), None)
    check_serves(config(tmp_path, "vlm_qwen3"), None)  # no template beside the tokenizer: the built-in ChatML
    (tmp_path / "text.jinja").write_text(TEXT_TEMPLATE)
    check_serves(config(tmp_path, "vlm_smollm2", chat_template=str(tmp_path / "text.jinja")), None)  # text-only
    check_serves(load_config(str(CONFIG / "vla_demo_orin.yaml")), None)  # not a chat model: nothing to check
