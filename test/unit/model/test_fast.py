"""π0-FAST's action codec (model/heads/fast.py) without LeRobot: a word-level backbone tokenizer and a FAST BPE
trained here on coefficient strings. A chunk encoded the way FAST encodes (orthonormal DCT along time, scaled,
rounded, characters, BPE, ids counted down from the end of the vocabulary) decodes back within the rounding; the
inverse DCT is scipy's; what cannot be decoded is refused with the reason. (Against LeRobot itself:
parity/test_pi0_fast_lerobot.py.)"""
from __future__ import annotations

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from synflux_ros.core.config import ConfigError  # noqa: E402
from synflux_ros.model.heads.fast import FastCodec, idct_matrix  # noqa: E402
from synflux_ros.model.tokenizer import HFTokenizer  # noqa: E402

BASE, SKIP, SCALE, MIN_TOKEN = 3000, 128, 10.0, -354
H, D = 10, 4


def dct_ortho(x: np.ndarray) -> np.ndarray:
    """The orthonormal DCT-II along axis 0, written out (what FAST's encoder applies)."""
    n = x.shape[0]
    k, t = np.arange(n)[:, None], np.arange(n)[None, :]
    m = np.cos(np.pi * k * (2 * t + 1) / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m @ x


def coefficient_strings(rng, count: int) -> list[str]:
    return ["".join(chr(int(c) - MIN_TOKEN) for c in np.rint(dct_ortho(rng.normal(0, 0.6, (H, D))) * SCALE).ravel())
            for _ in range(count)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("fast")
    words = ["<pad>", "<eos>", "<bos>", "Action", ":", " ", "|", "Task", ",", "State", ";", "\n", "pick", "up",
             *[str(i) for i in range(256)]]
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"<filler_{i}>": i for i in range(len(words), BASE)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), behavior="isolated")
    tok.save(str(d / "tokenizer.json"))
    fast = Tokenizer(models.BPE())
    fast.decoder = decoders.Fuse()  # tokens joined as they are (without a decoder, tokenizers puts spaces between)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=[chr(i) for i in range(700)], show_progress=False)
    fast.train_from_iterator(coefficient_strings(np.random.default_rng(0), 400), trainer)
    fast.save(str(d / "fast.json"))
    return d


def encode(files, actions: np.ndarray) -> list[int]:
    """What π0-FAST generates for a normalised chunk: 'Action: ', the FAST tokens as backbone ids, '|'."""
    from tokenizers import Tokenizer
    tok, fast = HFTokenizer(str(files / "tokenizer.json"), BASE), Tokenizer.from_file(str(files / "fast.json"))
    text = "".join(chr(int(c) - MIN_TOKEN) for c in np.rint(dct_ortho(actions) * SCALE).ravel())
    return tok.encode("Action: ") + [BASE - 1 - SKIP - k for k in fast.encode(text).ids] + [tok.token_id("|")]


def codec(files, **kw) -> FastCodec:
    return FastCodec(HFTokenizer(str(files / "tokenizer.json"), BASE), str(files / "fast.json"), kw.get("h", H), D,
                     SCALE, MIN_TOKEN, SKIP)


def test_the_inverse_dct_is_scipys_orthonormal_dct_iii():
    rng = np.random.default_rng(1)
    c = rng.normal(size=(7, 3))
    np.testing.assert_allclose(dct_ortho(idct_matrix(7) @ c), c, atol=1e-12)
    fftpack = pytest.importorskip("scipy.fftpack")
    np.testing.assert_allclose(idct_matrix(7) @ c, fftpack.idct(c, axis=0, norm="ortho"), atol=1e-12)


def test_a_chunk_decodes_back_within_the_rounding(files):
    rng = np.random.default_rng(2)
    actions = rng.normal(0, 0.6, (H, D))
    ids = encode(files, actions)
    got = codec(files).decode(ids)
    assert got.shape == (H, D) and got.dtype == np.float32
    # rounding moves each coefficient by <= 0.5 / scale; the orthonormal inverse keeps that norm
    assert np.linalg.norm(got - actions) <= 0.5 / SCALE * np.sqrt(H * D) + 1e-6
    assert np.abs(got - actions).max() > 0  # quantised, not the input
    # what follows '|' is not read; a second 'Action: ' inside is dropped, as LeRobot drops every occurrence
    np.testing.assert_array_equal(codec(files).decode(ids + ids[3:9]), got)
    tok = HFTokenizer(str(files / "tokenizer.json"), BASE)
    np.testing.assert_array_equal(codec(files).decode(ids[:5] + tok.encode("Action: ") + ids[5:]), got)


def test_relaxed_decoding_cuts_or_pads_the_coefficients(files):
    rng = np.random.default_rng(3)
    ids = encode(files, rng.normal(0, 0.6, (H, D)))
    short = codec(files, h=H + 2).decode(ids)  # more steps than coefficients: the rest are zero
    assert short.shape == (H + 2, D)
    long = codec(files, h=H - 4).decode(ids)  # fewer: the first (H - 4) * D coefficients are kept
    assert long.shape == (H - 4, D) and np.isfinite(long).all()


def test_what_cannot_be_decoded_is_refused_with_the_reason(files):
    ids = encode(files, np.zeros((H, D)))
    tok = HFTokenizer(str(files / "tokenizer.json"), BASE)
    with pytest.raises(ValueError, match=r"do not start with 'Action:' \(they start with \['pick', ' '\]\)"):
        codec(files).decode(tok.encode("pick up") + ids[3:])
    with pytest.raises(ValueError, match="map outside the FAST vocabulary"):
        codec(files).decode(ids[:3] + [tok.token_id("pick")] + ids[3:])
    with pytest.raises(ConfigError, match="action.fast_tokenizer"):
        FastCodec(tok, str(files / "missing.json"), H, D, SCALE, MIN_TOKEN, SKIP)


def test_config_rules():
    from pathlib import Path
    from synflux_ros.core.config import load_config
    from synflux_ros.model.normalization import PI0_FAST_PROMPT
    base = load_config(str(Path(__file__).resolve().parents[3] / "config" / "vla_openvla.yaml"))
    fast = {"token_codec": "fast", "fast_tokenizer": "fast.json", "norm_q01": [], "norm_q99": [], "norm_mask": [],
            "token_vocab_size": 0}
    cfg = base.with_overrides(action={**fast, "state_dim": 8, "state_joints": ["a", "b"], "state_input": "prompt",
                                      "state_norm": {"mode": "mean_std", "mean": [0, 0], "std": [1, 1]},
                                      "action_norm": {"mode": "mean_std", "mean": [0] * 7, "std": [1] * 7}},
                              tokenizer={"prompt_template": PI0_FAST_PROMPT, "prompt_end_token": "<s>"})
    assert cfg.action.state_token_dim == 0 and cfg.tokenizer.prompt_end_token == "<s>"
    assert base.with_overrides(action=fast).graph_hash() == base.with_overrides(
        action={**fast, "token_codec": "bins", "fast_tokenizer": ""}).graph_hash()  # the codec shapes no graph
    with pytest.raises(ConfigError, match="action.fast_tokenizer: token_codec fast needs the FAST tokenizer.json"):
        base.with_overrides(action={**fast, "fast_tokenizer": ""})
    with pytest.raises(ConfigError, match="bins codec options"):
        base.with_overrides(action={**fast, "num_bins": 128})
    with pytest.raises(ConfigError, match="takes the state in its prompt only"):
        base.with_overrides(action={**fast, "state_dim": 8, "state_joints": ["a"]})
    with pytest.raises(ConfigError, match="action.token_codec: fast is a codec of autoregressive heads"):
        load_config(str(Path(__file__).resolve().parents[3] / "config" / "vla_pi0.yaml")).with_overrides(
            action={"token_codec": "fast", "fast_tokenizer": "x.json"})
