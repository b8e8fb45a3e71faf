"""Qwen3-VL's multimodal rotary positions: the positions the runtime feeds (core.graphs.mrope_positions) equal
transformers' get_rope_index, the graphs' column-to-axis masks follow its interleaving, and configs that cannot
place images in 3-D are refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from synflux_ros.core.config import ConfigError, load_config
from synflux_ros.core.contract import graph_set
from synflux_ros.model.positions import mrope_positions

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
IMAGE = 99  # the image-pad id in these token lists


def layout(*counts):
    """Tokens as the runtime renders them, from counts alternating text, image, text, ...: ints for text,
    (key, row) for an image's rows."""
    tokens = []
    for i, n in enumerate(counts):
        tokens += list(range(10, 10 + n)) if i % 2 == 0 else [(i // 2, r) for r in range(n)]
    return tokens


def test_text_tokens_take_their_index_on_every_axis():
    pos, nxt = mrope_positions(list(range(7)), (2, 2), start=5)
    assert (pos == np.arange(5, 12)[None, :]).all() and nxt == 12


def test_an_image_takes_grid_positions_and_text_continues_after_its_longer_side():
    pos, nxt = mrope_positions(layout(4, 6, 2), (2, 3))  # 4 text, a 2x3 image, 2 text
    assert pos[0].tolist() == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8]
    assert pos[1].tolist() == [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8]
    assert pos[2].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    assert nxt == 9  # 12 tokens: the next cache position 12 decodes at rotary position 9


def test_misordered_image_rows_are_refused():
    with pytest.raises(ValueError, match="rows in order"):
        mrope_positions([1, (0, 0), (0, 2), (0, 1), (0, 3), 2], (2, 2))
    with pytest.raises(ValueError, match="expected its 4 rows"):
        mrope_positions([1, (0, 0), (0, 1), 2], (2, 2))


@pytest.mark.parametrize("images", [1, 2])
def test_positions_equal_transformers_get_rope_index(images):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[4, 2, 2])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16,
                           spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16),
        image_token_id=IMAGE, video_token_id=100, vision_start_token_id=101, vision_end_token_id=102)
    model = transformers.Qwen3VLModel(cfg).eval()
    rows, cols = 2, 3  # merged grid of a 64x96 image: 4x6 patches
    parts = [3, rows * cols, 2] if images == 1 else [3, rows * cols, 2, rows * cols, 4]
    tokens = layout(*parts)
    ids = torch.tensor([[IMAGE if isinstance(t, tuple) else t for t in tokens]])
    ref, delta = model.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).long(),
                                      image_grid_thw=torch.tensor([[1, 2 * rows, 2 * cols]] * images))
    ours, nxt = mrope_positions(tokens, (rows, cols))
    assert ours.tolist() == ref[:, 0].tolist()
    assert nxt - len(tokens) == int(delta)  # generated tokens: cache position + rope delta


def test_column_masks_follow_transformers_interleaving():
    torch = pytest.importorskip("torch")
    from synflux_ros.graphkit.torch_models.decoder import mrope_axis_masks
    axes = lambda m: "".join("thw"[int(a)] for a in m.argmax(0)[:m.shape[1] // 2])  # noqa: E731
    m = mrope_axis_masks(16, (4, 2, 2))
    assert axes(m) == "thwthwtt" and torch.equal(m.sum(0), torch.ones(16))
    assert torch.equal(m[:, :8], m[:, 8:])  # both halves of the rotate-half layout
    # transformers reads a section by stride, not by count: [2, 3, 3] gives h 3 columns, w 2 and t 3
    assert axes(mrope_axis_masks(16, (2, 3, 3))) == "thwthwth"
    assert axes(mrope_axis_masks(128, (24, 20, 20))) == "thw" * 20 + "tttt"


def test_the_graph_contract_of_an_mrope_deepstack_config():
    cfg = load_config(str(CONFIG_DIR / "vlm_qwen3.yaml"))
    metas = {m.name: m for m in graph_set(cfg)}
    assert [t.name for t in metas["vision_encoder"].outputs] == ["vision_embeds", "deepstack_embeds"]
    assert metas["vision_encoder"].output("deepstack_embeds").shape == (3, 196, 4096)
    prefill = metas["prefill_128"]
    assert prefill.input("position_ids").shape == (3, 128) and prefill.input("position_ids").dtype == "int64"
    assert prefill.input("deepstack_embeds").shape == (3, 128, 4096)
    assert metas["decode_1024"].input("position_ids").shape == (3, 1)
    # a 1-D model's graphs have neither
    plain = load_config(str(CONFIG_DIR / "vlm_demo.yaml"))
    names = {t.name for m in graph_set(plain) for t in (*m.inputs, *m.outputs)}
    assert not names & {"position_ids", "deepstack_embeds"}


def test_configs_that_cannot_place_images_in_3d_are_refused():
    qwen = load_config(str(CONFIG_DIR / "vlm_qwen3.yaml"))
    with pytest.raises(ConfigError, match="summing to head_dim / 2 \\(64\\)"):
        qwen.with_overrides(llm={"mrope_section": [24, 20, 10]})
    with pytest.raises(ConfigError, match="vision.architecture qwen3_vl with one tile"):
        load_config(str(CONFIG_DIR / "vlm_demo.yaml")).with_overrides(llm={"mrope_section": [4, 2, 2]})
    with pytest.raises(ConfigError, match="vlm configs only"):
        load_config(str(CONFIG_DIR / "vla_demo_orin.yaml")).with_overrides(llm={"mrope_section": [4, 2, 2]})
    text_only = qwen.with_overrides(vision=None)  # a Qwen3-VL text model without images: positions are 1-D
    assert text_only.llm.mrope_section == (24, 20, 20)
