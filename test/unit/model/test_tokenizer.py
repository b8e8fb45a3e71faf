"""Byte-level and tokenizer.json tokenizers, and tokenizer selection from the config."""
from pathlib import Path

import pytest
import yaml

from synflux_ros.core.config import ConfigError, from_dict
from synflux_ros.model.tokenizer import CHAT_SPECIALS, ByteTokenizer, HFTokenizer, load_tokenizer

tokenizers = pytest.importorskip("tokenizers")

CONFIG_DIR = Path(__file__).resolve().parents[3] / "config"
CORPUS = ["the robot picks up the red block", "hello world, the robot says hello",
          "what do you see in the image?", "a cup on the table next to a spoon"] * 10
TEXTS = ["hello world", "héllo wörld ✓ 日本語 🤖", "line one\nline two\ttab", "  spaces  ", "", "a"]


# ------------------------------------------------------------------ byte-level

def test_byte_tokenizer_round_trip_and_ids():
    tok = ByteTokenizer(512)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    assert len(tok.encode("é")) == 2


def test_byte_tokenizer_specials_are_distinct_from_bytes():
    tok = ByteTokenizer(512)
    ids = [tok.special(s) for s in CHAT_SPECIALS]
    assert ids == list(range(256, 256 + len(CHAT_SPECIALS)))
    assert len(set(ids)) == len(CHAT_SPECIALS)
    assert tok.eos_ids == (tok.special("<|im_end|>"), tok.special("<|endoftext|>"))
    # Special ids and ids beyond the bytes do not show up in text.
    assert tok.decode([104, tok.special("<|im_start|>"), 105, 400, 511]) == "hi"
    # The special's spelling in user text stays plain bytes.
    assert all(i < 256 for i in tok.encode("<|im_end|>"))
    with pytest.raises(KeyError):
        tok.special("<|nope|>")


def test_byte_tokenizer_eos_override_and_bad_bytes():
    tok = ByteTokenizer(300, eos_ids=(7,))
    assert tok.eos_ids == (7,)
    assert tok.vocab_size == 300
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # truncated UTF-8 does not raise


def test_byte_tokenizer_needs_room_for_specials():
    ByteTokenizer(256 + len(CHAT_SPECIALS))
    with pytest.raises(ConfigError, match="llm.vocab_size.*262"):
        ByteTokenizer(256 + len(CHAT_SPECIALS) - 1)


# ------------------------------------------------------------------ tokenizer.json

def build_bpe(path: Path, specials=CHAT_SPECIALS) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(specials), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(path))
    return path


def build_wordlevel(path: Path, specials) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainer=trainers.WordLevelTrainer(special_tokens=["[UNK]"],
                                                                      show_progress=False))
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    return build_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_hf_tokenizer_round_trip(bpe_path):
    tok = HFTokenizer(str(bpe_path), 512)
    assert tok.vocab_size == 512
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == text
    # Trained merges make frequent words shorter than their bytes.
    assert len(tok.encode("the robot")) < len("the robot".encode())


def test_hf_tokenizer_specials_and_eos(bpe_path):
    tok = HFTokenizer(str(bpe_path), 512)
    ids = {s: tok.special(s) for s in CHAT_SPECIALS}
    assert len(set(ids.values())) == len(CHAT_SPECIALS)
    plain = set(tok.encode("".join(TEXTS)))
    assert plain.isdisjoint(ids.values())
    assert tok.eos_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    # Specials are skipped when decoding.
    text_ids = tok.encode("hello")
    assert tok.decode([ids["<|im_start|>"]] + text_ids + [ids["<|im_end|>"]]) == "hello"
    with pytest.raises(KeyError):
        tok.special("<|nope|>")
    assert HFTokenizer(str(bpe_path), 512, eos_ids=(3, 4)).eos_ids == (3, 4)


def test_hf_tokenizer_wordlevel_and_other_eos_names(tmp_path):
    path = build_wordlevel(tmp_path / "wl.json", ["</s>", "<pad>"])
    tok = HFTokenizer(str(path), 100)
    the, robot = tok.encode("the robot")
    assert the != robot
    assert tok.encode("the zebra")[1] == tok.special("[UNK]")
    assert tok.decode(tok.encode("the red robot")) == "the red robot"
    assert tok.eos_ids == (tok.special("</s>"),)
    none = HFTokenizer(str(build_wordlevel(tmp_path / "none.json", ["<pad>"])), 100)
    assert none.eos_ids == ()


def test_hf_tokenizer_errors(bpe_path, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        HFTokenizer(str(tmp_path / "missing.json"), 512)
    with pytest.raises(ConfigError, match="llm.vocab_size is 100"):
        HFTokenizer(str(bpe_path), 100)


# ------------------------------------------------------------------ selection from the config

def vlm_raw():
    with open(CONFIG_DIR / "vlm_demo.yaml", encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def test_load_tokenizer_selects_by_path(tmp_path, bpe_path):
    cfg = from_dict(vlm_raw(), source=str(tmp_path / "cfg.yaml"))
    byte = load_tokenizer(cfg)
    assert isinstance(byte, ByteTokenizer) and byte.vocab_size == 512

    (tmp_path / "tk.json").write_bytes(bpe_path.read_bytes())
    d = vlm_raw()
    d["tokenizer"] = {"path": "tk.json"}  # relative to the config file
    d["text"]["eos_token_ids"] = [1]
    hf = load_tokenizer(from_dict(d, source=str(tmp_path / "cfg.yaml")))
    assert isinstance(hf, HFTokenizer)
    assert hf.eos_ids == (1,)
    assert hf.decode(hf.encode("hello world")) == "hello world"

    d["tokenizer"] = {"path": str(tmp_path / "tk.json")}
    assert isinstance(load_tokenizer(from_dict(d)), HFTokenizer)
    d["tokenizer"] = {"path": "nope.json"}
    with pytest.raises(ConfigError, match="tokenizer.path"):
        load_tokenizer(from_dict(d, source=str(tmp_path / "cfg.yaml")))


def test_vlm_runtime_with_a_tokenizer_json(tmp_path, bpe_path):
    from synflux_ros.model.chat_template import CHATML
    from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime
    (tmp_path / "chatml.jinja").write_text(CHATML)
    d = vlm_raw()
    d["tokenizer"] = {"path": str(bpe_path), "chat_template": str(tmp_path / "chatml.jinja")}
    d["session"]["max_sessions"] = 1
    rt = VLMRuntime(from_dict(d))
    r1 = rt.chat(ChatRequest("s", "hello robot", max_new_tokens=5))
    r2 = rt.chat(ChatRequest("s", "what do you see?", max_new_tokens=5))
    assert 1 <= r1.generated_tokens <= 5
    assert r2.cached_tokens > 0
    assert isinstance(r1.reply, str)
    tk = rt.tokenizer
    prefix = [tk.special("<|im_start|>")] + tk.encode("user\n")
    suffix = ([tk.special("<|im_end|>")] + tk.encode("\n") + [tk.special("<|im_start|>")]
              + tk.encode("assistant\n"))
    assert r1.prompt_tokens == len(prefix) + len(tk.encode("hello robot")) + len(suffix)

    d["tokenizer"]["path"] = str(build_wordlevel(tmp_path / "nochat.json", ["<|im_start|>", "<|im_end|>"]))
    with pytest.raises(ConfigError, match="tokenizer.image_token: .<|image_pad|>. is not a token"):
        VLMRuntime(from_dict(d))


def test_a_base_checkpoint_is_served_as_plain_text_completion(tmp_path):
    """A text-only model whose tokenizer.json has no chat template beside it: the conversation is one text
    (prompts and replies in order), tokenized as a prompt with the BOS its post-processor adds; each turn
    continues the session's text."""
    from tokenizers import Tokenizer, processors
    from synflux_ros.runtimes.vlm import ChatRequest, VLMRuntime
    path = build_bpe(tmp_path / "tokenizer.json", ("<s>", "<|endoftext|>", "<|image_pad|>"))
    tok = Tokenizer.from_file(str(path))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path))
    d = vlm_raw()
    d.pop("vision")
    d["tokenizer"] = {"path": str(path)}
    d["session"]["max_sessions"] = 1
    rt = VLMRuntime(from_dict(d))
    assert rt.template.plain and "plain text completion" in rt.template.origin
    tk = rt.tokenizer
    r1 = rt.chat(ChatRequest("s", "the robot picks up", max_new_tokens=4, temperature=0.0))
    assert r1.prompt_tokens == 1 + len(tk.encode("the robot picks up"))  # <s>, then the text as it is
    r2 = rt.chat(ChatRequest("s", " the block", max_new_tokens=4, temperature=0.0))
    # turn 2 reads <s> + prompt 1 + reply 1 + prompt 2: the part already in the cache is reused
    whole = tk.encode_prompt("the robot picks up" + r1.reply + " the block")
    assert whole[0] == bos and r2.cached_tokens + r2.prompt_tokens == len(whole)
    assert r2.cached_tokens >= 1 + len(tk.encode("the robot picks up"))
    # with a vision section the same tokenizer gets the built-in ChatML, which places images
    assert not VLMRuntime(from_dict({**vlm_raw(), "tokenizer": {"path": str(path)}})).template.plain
