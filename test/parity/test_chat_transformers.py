"""Greedy chat through vlm_node (onnxruntime, fp32) equals transformers' generate on the same weights, with
the checkpoint's own chat template: several prompts, a conversation of three turns with a system prompt,
for text-only Llama, Qwen3, Qwen2 (biased q/k/v), Phi-3 (fused projections) and Gemma checkpoints (tiny, random weights); and a base checkpoint (no chat
template) served as plain text completion, each turn continuing the text."""
from __future__ import annotations

import json
import uuid

import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

import rclpy  # noqa: E402
from synflux_ros.buildtool import export as build_tool  # noqa: E402
from synflux_ros.tools import harness as testing  # noqa: E402

from checkpoints import write_tokenizer  # noqa: E402
from ros_clients import ChatClient, ok  # noqa: E402

pytestmark = pytest.mark.reference

NEW = 8
CHATML = (  # a ChatML template with a default system prompt, as small instruct checkpoints ship one
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful robot.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def hf_model(family: str, vocab: int):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=vocab, max_position_embeddings=512)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16,
                                                                      tie_word_embeddings=False))
    if family == "qwen2":  # biased q/k/v projections
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    if family == "phi3":  # fused qkv_proj and gate_up_proj tensors
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(**common, pad_token_id=0))
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**common, head_dim=16))


def serve(family: str, tmp_path_factory, ros_env, base: bool = False):
    """(transformers model, its tokenizer, eos ids, a chat client of vlm_node serving the same weights); ``base``:
    a tokenizer whose post-processor adds a BOS and no chat template (a base model)."""
    ckpt = tmp_path_factory.mktemp(f"{family}{'_base' if base else ''}_ckpt")
    write_tokenizer(str(ckpt), first_specials=("<s>",) if base else ())
    if base:
        from tokenizers import Tokenizer, processors
        raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
        raw.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({
        **({"bos_token": "<s>"} if base else {"chat_template": CHATML}), "eos_token": "<|im_end|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    torch.manual_seed(1)
    hf = hf_model(family, len(tok)).eval()
    with torch.no_grad():  # sharper logits than the default init, so greedy picks are not near-ties
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif name.endswith("_proj.bias"):  # zero at init: make Qwen2's biases count
                p.normal_(0.0, 1.0)
    hf.save_pretrained(ckpt)
    base = tmp_path_factory.mktemp("cfg") / "chat.yaml"
    base.write_text(yaml.safe_dump({
        "name": f"{family}-{'base' if base else 'chat'}", "mode": "vlm",
        "llm": {"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "vocab_size": len(tok),
                "prefill_buckets": [32, 128], "decode_buckets": [256, 512], "max_seq_len": 512},
        "text": {"max_new_tokens": NEW}, "session": {"max_sessions": 3}}))
    out = tmp_path_factory.mktemp(f"{family}_graphs")
    assert build_tool.main(["--config", str(base), "--out", str(out), "--from-hf", str(ckpt)]) == 0
    ns = f"/parity_{family}{'_base' if base else ''}"
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    node = rclpy.create_node(f"parity_client_{uuid.uuid4().hex[:8]}")
    with testing.NodeProcess("vlm_node", {"config": str(out / "config.yaml")}, env=ros_env,
                             remaps={"__ns": ns}) as proc:
        yield hf, tok, eos, ChatClient(node, ns)
        assert proc.alive(), proc.output()[-3000:]
    node.destroy_node()


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2", "phi3", "gemma"])
def served(request, tmp_path_factory, ros_env):
    yield from serve(request.param, tmp_path_factory, ros_env)


@pytest.fixture(scope="module")
def base_served(tmp_path_factory, ros_env):
    yield from serve("llama", tmp_path_factory, ros_env, base=True)


def reference(hf, tok, eos, messages) -> tuple[str, int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
        out = hf.generate(ids, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos[0])
    new = out[0, ids.shape[1]:].tolist()
    text = tok.decode([t for t in new if t not in eos], skip_special_tokens=True)
    return text, len(new)


@pytest.mark.parametrize("prompt", ["Pick up the red block.", "What is on the table?", "Where is the cup now?"])
def test_greedy_replies_equal_transformers_generate(served, prompt):
    hf, tok, eos, chat = served
    got = ok(chat.chat(f"p-{prompt}", prompt, temperature=0.0))
    want, n = reference(hf, tok, eos, [{"role": "user", "content": prompt}])
    assert (got.reply, got.generated_tokens) == (want, n)


def test_a_three_turn_conversation_with_a_system_prompt_equals_transformers(served):
    hf, tok, eos, chat = served
    messages = [{"role": "system", "content": "Answer briefly."}]
    for i, prompt in enumerate(["Where is the cup?", "Move it to the plate.", "And the spoon?"]):
        got = ok(chat.chat("conversation", prompt, temperature=0.0,
                           system_prompt="Answer briefly." if i == 0 else ""))
        messages.append({"role": "user", "content": prompt})
        want, n = reference(hf, tok, eos, messages)
        assert (got.reply, got.generated_tokens) == (want, n), f"turn {i + 1}"
        assert got.reply and (got.cached_tokens > 0) == (i > 0)
        messages.append({"role": "assistant", "content": got.reply})


def test_a_base_checkpoint_continues_the_text_as_transformers_generates(base_served):
    """No chat template: each turn's input is the session's text so far (prompts and replies in order) as
    transformers tokenizes a prompt (its BOS first), and the reply is what generate continues it with."""
    hf, tok, eos, chat = base_served
    text = ""
    for i, prompt in enumerate(["the robot picks up", " the red block and", " puts it"]):
        got = ok(chat.chat("base", prompt, temperature=0.0))
        text += prompt
        ids = tok(text, return_tensors="pt").input_ids
        assert ids[0, 0].item() == tok.convert_tokens_to_ids("<s>")
        with torch.no_grad():
            out = hf.generate(ids, do_sample=False, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=eos[0])
        new = out[0, ids.shape[1]:].tolist()
        want = tok.decode([t for t in new if t not in eos], skip_special_tokens=True)
        assert (got.reply, got.generated_tokens) == (want, len(new)), f"turn {i + 1}"
        assert (got.cached_tokens > 0) == (i > 0)
        text += got.reply
