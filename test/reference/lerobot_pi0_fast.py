#!/usr/bin/env python3
"""LeRobot's π0-FAST (``lerobot.policies.pi0_fast``) as the reference the project's π0-FAST is compared with, in
release 0.4.4 or 0.6.1: whichever the interpreter has.

Run it with the interpreter of ``.venv-pi0ref`` (``make pi0ref-venv``): torch 2.13 CPU, stock transformers 4.53.2,
scipy and lerobot 0.4.4 installed without its dependencies; or of ``.venv-lerobot06`` (``make lerobot06-venv``,
LeRobot 0.6.1 on stock transformers 5.5.4: no shim). π0-FAST is PaliGemma alone (no action expert) and
relies on the same fix/lerobot_openpi transformers branch as π0, so lerobot_pi0.py's shim is installed first; the
helpers shared with π0 (shim, torchvision placeholder, dataset statistics, weight randomisation, sizes, processor
loading) are imported from there.

Subcommands
    check            make a minute π0-FAST here, generate its tokens once with and once without LeRobot's KV cache,
                     and decode an encoded chunk back (the venv's smoke test)
    make-checkpoint  build a small π0-FAST with random weights and save it as a checkpoint directory of the
                     installed LeRobot, with stand-ins for the two tokenizers LeRobot fetches from the Hub
    run              load such a checkpoint with LeRobot and generate one chunk from an .npz of inputs: LeRobot's
                     preprocessor (normaliser, state written into the prompt, tokenizer step), then
                     ``predict_action_chunk`` (greedy autoregressive FAST tokens, detokenised to actions)
    decode           LeRobot's own detokenisation (``PI0FastPolicy.detokenize_actions``, what predict_action_chunk
                     runs after generating) of given token ids
    encode           the token ids the model would emit for given normalised actions ("Action: ", the FAST ids
                     mapped into the PaliGemma vocabulary, "|", <eos>, then <pad>), built by LeRobot's own
                     ActionTokenizerProcessorStep (the training targets, without their leading <bos>)

What LeRobot fetches from the Hub, and the stand-ins make-checkpoint writes beside the checkpoint
    PI0FastPolicy, TokenizerProcessorStep and ActionTokenizerProcessorStep load ``google/paligemma-3b-pt-224`` with
    AutoTokenizer and ``physical-intelligence/fast`` with AutoProcessor(trust_remote_code=True). Both loaders are
    replaced, while LeRobot builds or loads the policy and its processors, by ones that answer for exactly those
    names (config.json's text_tokenizer_name / action_tokenizer_name) from the checkpoint directory:

    tokenizer.json, tokenizer_config.json   the PaliGemma tokenizer, Gemma's layout: 257152 ids (PaliGemma's, which
        LeRobot's FAST id mapping depends on) -- <pad> 0, <eos> 1, <bos> 2, <unk> 3 (special), the byte-fallback
        pieces <0x00>..<0xFF> 4..259, then the pieces of a BPE trained here on prompts (ASCII letters, digits and
        punctuation, "\\n", "▁", whole words of robot tasks such as "▁pick", "Task", "State", "Action"), then
        <unusedN> fillers up to 255999, <loc0000>..<loc1023> 256000..257023 and <seg000>..<seg127>
        257024..257151. As in Gemma's tokenizer.json: the normaliser replaces " " by "▁", there is no
        pre-tokeniser (digits are single pieces: no merge joins them), byte fallback, a decoder undoing "▁" and
        the byte pieces, and a post-processor that prepends <bos>. tokenizer_config.json names GemmaTokenizer with
        add_bos_token true, add_eos_token false, as PaliGemma's does.
        It is loaded as transformers' GemmaTokenizerFast (what AutoTokenizer gives for PaliGemma's), passing
        LeRobot's keyword arguments: the class rebuilds its post-processor from add_bos_token/add_eos_token, so
        the preprocessor's tokenizer step prepends <bos> to the prompt, and the policy's and the action step's
        (add_eos_token=True, add_bos_token=False) encode "|" as ["|", <eos>]. A plain PreTrainedTokenizerFast
        would keep the two flags in init_kwargs only and do whatever tokenizer.json's post-processor does.
        "Action: " (encode, add_special_tokens=False) is ["Action", ":", "▁"]; "|" is a single piece.
    fast/tokenizer.json, fast/tokenizer_config.json, fast/processor_config.json   the FAST action tokenizer. The
        real one, as its processor's fit() makes it, is a byte-level BPE (tokenizers' ByteLevelBPETokenizer:
        ByteLevel pre-tokeniser with its regex, decoder and post-processor) over strings of chr(coefficient -
        min_token), one character per quantised DCT coefficient, flattened frequency-major (all action dimensions
        of the lowest frequency first), trained with the whole range chr(0..max-min) as initial alphabet,
        min_frequency 2, max_token_length 10000. The stand-in
        is trained the same way here on smooth synthetic chunks (horizons 5-50, 1-14 dimensions, coefficients
        clipped to [-354, 354]): vocab_size 2048, the 709 alphabet characters as ids 0..708 and 1339 merges (runs
        of zero coefficients first). processor_config.json: scale 10, min_token -354, vocab_size 2048.
        tokenizer_config.json sets clean_up_tokenization_spaces false, as the processor's own fit() saves it, so
        transformers' decode applies no space clean-up to the coefficient string. The processor is
        ``FastActionTokenizer``: LeRobot's decoding uses only its ``bpe_tokenizer.decode``, ``min_token`` and
        ``scale``; calling it (actions [T, D] or [B, T, D] -> one id list per chunk) is what
        ActionTokenizerProcessorStep does with it when building training targets and ``encode`` here.

    The FAST ids live at the top of the PaliGemma vocabulary, counted down: paligemma_id = vocab_size - 1 -
    fast_skip_tokens - fast_id, i.e. 257023 - fast_id with the default fast_skip_tokens 128 (the <seg###> ids are
    skipped), so FAST ids 0..2047 are PaliGemma ids 257023..254976 (<loc1023>.. down into the <unusedN> fillers);
    the prompt pieces are far below. vocab_size is the tokenizer's (257152: every id is in the BPE model's vocab).

tiny_dims.json
    As lerobot_pi0.py's, without "expert" (π0-FAST has no action expert: the config's action_expert_variant is
    never built), with "policy": "pi0_fast", the vision config's image_size taken from "vision" too (LeRobot's
    π0-FAST leaves SigLIP at PaliGemma's default 224 whatever image_resolution says), and what the stand-ins
    hold:
    {"format": 1, "seed": int, "vocab_size": 257152, "policy": "pi0_fast",
     "vlm":    {"variant": "gemma_2b", "width", "depth", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"},
     "vision": {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
                "image_size", "num_image_tokens"},
     "tokenizers": {
        "text": {"file": "tokenizer.json", "vocab_size": 257152, "pad_id", "eos_id", "bos_id", "unk_id",
                 "action_prefix_ids": ids of "Action: ", "end_of_action_id": id of "|", "text_pieces": how many ids
                 (from 0) are specials, bytes and trained pieces},
        "fast": {"dir": "fast", "vocab_size": 2048, "scale": 10, "min_token": -354, "fast_skip_tokens": config's,
                 "paligemma_id_of_fast_0": 257023, "paligemma_id_of_fast_last": 254976}}}

What run computes
    The observation goes the way lerobot-record's predict_action sends it: uint8 HxWx3 images to float [0, 1] CHW,
    a batch dimension, then the checkpoint's preprocessor: the normaliser (MEAN_STD by default), the state padded to
    32 and cut into 256 bins of [-1, 1] (-1 below) and written into the prompt "Task: <task>, State: <bins>;\\n",
    which the tokenizer step turns into <bos> + pieces, cut to tokenizer_max_length and padded on the right with
    <pad>. predict_action_chunk appends one more <bos> after the padded prompt (its position is the number of valid
    prompt ids: positions count only unpadded tokens), runs the prefix [images, prompt, <bos>] once, every valid
    token attending to every other (the appended <bos> is one more language token, so the prompt sees it too; the
    padding is masked out), then generates max_decoding_steps tokens greedily (temperature 0), the first from the
    <bos>'s logits and each next one attending to every valid token before it and itself (with the KV cache by
    default; --kv-cache off recomputes the whole sequence each step, with the same tokens). No step stops at "|"
    or <eos>: all max_decoding_steps are generated.
    Then detokenize_actions: the ids become pieces; with validate_action_token_prefix (LeRobot's default) the
    first two must be "Action" and ":" or an AssertionError is raised; everything from the first "|" on is cut,
    every ["Action", ":", "▁"] removed, the rest mapped to FAST ids and decoded with relaxed decoding: the
    coefficient string is cut or zero-padded to n_action_steps x action_dim (n_action_steps, not chunk_size),
    reshaped frequency-major, divided by scale and inverse-DCT'd (scipy.fftpack.idct, orthonormal) along time. The
    byte-level decoder turns the pieces' bytes into text as UTF-8 with U+FFFD for invalid sequences (a lone lead
    byte is one coefficient of 65533 + min_token); a FAST id beyond its vocabulary (from a PaliGemma id below the
    FAST range, <eos> and <pad> included) decodes to nothing; a negative one (from a PaliGemma id above the range,
    a <seg###>) makes the decode raise, and LeRobot then decodes zeros and logs "Error decoding tokens". The
    postprocessor un-normalises.

Results (the JSON line on stdout)
    run: prompt, prompt_ids (the valid ids the tokenizer step made, <bos> first), prompt_ids_untruncated (how many
    the prompt has uncut), lang_padded_to, appended_bos_id, sampler (which of LeRobot's samplers ran),
    temperature, max_decoding_steps, tokens (all generated ids), pieces, action_prefix (the first two pieces are
    "Action", ":"), first_end_of_action / first_eos (index of the first "|" / <eos>, or null), in_fast_range,
    logit_margins / min_logit_margin (top logit minus the second, per step), and what detokenize_actions did:
    validate_action_token_prefix, outcome ("actions" or "raised"), error ("AssertionError: ..." when the
    prefix check failed), warnings, fast_ids (what it handed decode_actions_with_fast), coefficients (characters
    the FAST tokenizer decoded them to), expected_coefficients, fell_back_to_zeros; actions_shape when it gave
    actions. --out .npz: prompt, prompt_ids, lang_tokens, lang_mask, state_normalized, tokens, and actions
    [n_action_steps, action dim] and actions_normalized when it gave actions.
    decode: the same detokenisation fields, actions_normalized and actions ([B, T, D] for [B, L] ids).
    encode: tokens (--length ids), valid (how many before the <pad>s), truncated, fast_ids, coefficients [T, D]
    (the quantised DCT, round half to even), fast_skip_tokens, scale, min_token.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from lerobot_pi0 import (  # noqa: E402  (also sets HF_HUB_OFFLINE: nothing here may reach the Hub)
    DEFAULT_TASK,
    DIMS_FILE,
    NORM_MODES,
    PATCH_SIZE,
    VOCAB_SIZE,
    add_option_flags,
    checkpoint_options,
    dataset_stats,
    feature_config,
    gemma_dims,
    install_torchvision_placeholder,
    load_processors,
    patch_model_dims,
    prepare_lerobot,
    print_result,
    randomize_weights,
    save_checkpoint,
    shape_problems,
    verify_weights,
    vision_dims,
)

POLICY_TYPE = "pi0_fast"
LANG_TOKENS = "observation.language.tokens"
LANG_MASK = "observation.language.attention_mask"

# --------------------------------------------------------------------------------------------------------------
# The PaliGemma tokenizer stand-in

TEXT_TOKENIZER_FILE = "tokenizer.json"
TEXT_TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, as in PaliGemma's vocabulary
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
LOC_TOKENS = 1024  # PaliGemma's vocabulary ends with <loc0000>..<loc1023> and <seg000>..<seg127>
SEG_TOKENS = 128
ACTION_PREFIX = "Action: "
END_OF_ACTION = "|"
TEXT_TRAINING_SEED = 0  # the stand-in is the same for every checkpoint
TEXT_TRAINING_VOCAB = 600
TASK_WORDS = (
    "pick up the object put place red blue green yellow white black cube block ball in on into onto box bowl "
    "basket drawer open close push pull move left right top bottom of a and to it cup mug plate sponge towel fold "
    "stack bottle door lift grasp turn off light switch pour water from table shelf near next back front small big "
    "insert peg hole wipe clean sort objects items pen marker bin tray lid"
).split()
PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"


def _text_training_lines(rng: np.random.Generator):
    """Prompts as π0-FAST's preprocessor writes them, and the target that follows them."""
    for _ in range(3000):
        task = " ".join(rng.choice(TASK_WORDS, int(rng.integers(1, 8))))
        state = " ".join(str(v) for v in rng.integers(-1, 256, int(rng.integers(1, 33))))
        yield f"Task: {task}, State: {state};\n"
        yield ACTION_PREFIX + END_OF_ACTION


def build_text_tokenizer(directory: Path) -> dict:
    """Write the PaliGemma stand-in (tokenizer.json, tokenizer_config.json) into ``directory``; returns the
    sidecar's "text" entry.

    The pieces come from a BPE trained on prompts with words, digits and punctuation kept apart (letters after a
    space start with "▁"); they are then used without that split, as Gemma's tokenizer has no pre-tokeniser: no
    learned merge joins two of those parts, so the pieces are the same either way.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    alphabet = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + PUNCTUATION)
                      | {"▁", "\n", "\t"})
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Replace(" ", "▁")
    trainer_tok.pre_tokenizer = pre_tokenizers.Split(Regex("▁?[A-Za-z]+|[^A-Za-z▁]|▁"), behavior="isolated")
    trainer = BpeTrainer(vocab_size=TEXT_TRAINING_VOCAB, min_frequency=2, show_progress=False,
                         initial_alphabet=alphabet, special_tokens=[])
    trainer_tok.train_from_iterator(_text_training_lines(np.random.default_rng(TEXT_TRAINING_SEED)), trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    vocab = {piece: i for i, piece in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    text_pieces = len(vocab)
    first_loc = VOCAB_SIZE - LOC_TOKENS - SEG_TOKENS
    vocab.update({f"<unused{i}>": i for i in range(text_pieces, first_loc)})
    vocab.update({f"<loc{i:04d}>": first_loc + i for i in range(LOC_TOKENS)})
    vocab.update({f"<seg{i:03d}>": first_loc + LOC_TOKENS + i for i in range(SEG_TOKENS)})
    if len(vocab) != VOCAB_SIZE or sorted(vocab.values()) != list(range(VOCAB_SIZE)):
        raise RuntimeError("the PaliGemma stand-in's vocabulary is not ids 0..257151")

    merges = [tuple(pair) for pair in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", BOS_ID)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / TEXT_TOKENIZER_FILE), pretty=False)
    (directory / TEXT_TOKENIZER_CONFIG).write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")

    # What LeRobot's policy and action step rely on.
    tokenizer = load_text_tokenizer(directory, add_eos_token=True, add_bos_token=False)
    prefix = tokenizer.encode(ACTION_PREFIX, add_special_tokens=False)
    if tokenizer.convert_ids_to_tokens(prefix) != ["Action", ":", "▁"]:
        raise RuntimeError(f"the stand-in splits {ACTION_PREFIX!r} as {tokenizer.convert_ids_to_tokens(prefix)}")
    end = tokenizer.encode(END_OF_ACTION)
    if len(end) != 2 or end[1] != EOS_ID or tokenizer.convert_ids_to_tokens(end[0]) != END_OF_ACTION:
        raise RuntimeError(f"the stand-in encodes {END_OF_ACTION!r} as {end}")
    if tokenizer.vocab_size != VOCAB_SIZE or tokenizer.bos_token_id != BOS_ID:
        raise RuntimeError("the stand-in's vocab_size or <bos> is not PaliGemma's")
    return {
        "file": TEXT_TOKENIZER_FILE,
        "vocab_size": VOCAB_SIZE,
        "pad_id": PAD_ID,
        "eos_id": EOS_ID,
        "bos_id": BOS_ID,
        "unk_id": UNK_ID,
        "action_prefix_ids": prefix,
        "end_of_action_id": end[0],
        "text_pieces": text_pieces,
    }


def load_text_tokenizer(directory: Path, **kwargs):
    """The stand-in as transformers' GemmaTokenizerFast (what AutoTokenizer makes of PaliGemma's tokenizer), with
    LeRobot's keyword arguments (add_bos_token / add_eos_token rebuild its post-processor)."""
    try:
        from transformers.models.gemma.tokenization_gemma_fast import GemmaTokenizerFast
    except ImportError:  # transformers 5 (LeRobot 0.6): GemmaTokenizer is the tokenizers-backed one
        from transformers.models.gemma.tokenization_gemma import GemmaTokenizer as GemmaTokenizerFast

    kwargs.pop("trust_remote_code", None)
    return GemmaTokenizerFast.from_pretrained(str(directory), local_files_only=True, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# The FAST action tokenizer stand-in

FAST_DIR = "fast"
FAST_PROCESSOR_CONFIG = "processor_config.json"
FAST_VOCAB_SIZE = 2048
FAST_SCALE = 10
FAST_MIN_TOKEN = -354
FAST_MAX_TOKEN = 354  # the training chunks' coefficients are clipped to [min, max]: the alphabet is chr(0..708)
FAST_TRAINING_SEED = 0  # the stand-in is the same for every checkpoint
FAST_TRAINING_CHUNKS = 3000


def _dct(actions: np.ndarray) -> np.ndarray:
    """The orthonormal DCT-II along time (axis 0) -- FAST's transform."""
    from scipy.fft import dct

    return dct(actions, axis=0, norm="ortho")


def _fast_training_strings(rng: np.random.Generator):
    """Coefficient strings of smooth random chunks: a few low-frequency cosines per dimension and a little noise,
    of order one like normalised actions."""
    for _ in range(FAST_TRAINING_CHUNKS):
        horizon = int(rng.choice([5, 8, 10, 16, 25, 50]))
        dims = int(rng.integers(1, 15))
        t = np.linspace(0.0, 1.0, horizon)[:, None]
        chunk = rng.normal(0.0, 0.02, (horizon, dims))
        for k in range(4):
            freq = k * rng.uniform(0.5, 1.5)
            chunk += rng.normal(0.0, 0.6 / (k + 1), dims) * np.cos(np.pi * freq * t + rng.uniform(0, 2 * np.pi, dims))
        coefficients = np.clip(np.around(_dct(chunk) * FAST_SCALE), FAST_MIN_TOKEN, FAST_MAX_TOKEN).astype(int)
        yield "".join(map(chr, (coefficients - FAST_MIN_TOKEN).reshape(-1)))


def build_fast_tokenizer(directory: Path) -> dict:
    """Write the FAST stand-in (tokenizer.json, tokenizer_config.json, processor_config.json) into ``directory``;
    returns the sidecar's "fast" entry (without the config's skip)."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    trainer = BpeTrainer(vocab_size=FAST_VOCAB_SIZE, min_frequency=2, show_progress=False, special_tokens=[],
                         initial_alphabet=[chr(i) for i in range(FAST_MAX_TOKEN - FAST_MIN_TOKEN + 1)],
                         max_token_length=10000)
    bpe._tokenizer.train_from_iterator(_fast_training_strings(np.random.default_rng(FAST_TRAINING_SEED)),
                                       trainer=trainer)
    if bpe._tokenizer.get_vocab_size() != FAST_VOCAB_SIZE:
        raise RuntimeError(f"the FAST stand-in has {bpe._tokenizer.get_vocab_size()} ids, not {FAST_VOCAB_SIZE}")
    directory.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, clean_up_tokenization_spaces=False).save_pretrained(
        str(directory))
    (directory / FAST_PROCESSOR_CONFIG).write_text(json.dumps({
        "processor_class": "UniversalActionProcessor",
        "scale": FAST_SCALE,
        "vocab_size": FAST_VOCAB_SIZE,
        "min_token": FAST_MIN_TOKEN,
        "action_dim": None,
        "time_horizon": None,
    }, indent=2) + "\n")
    return {"dir": FAST_DIR, "vocab_size": FAST_VOCAB_SIZE, "scale": FAST_SCALE, "min_token": FAST_MIN_TOKEN}


class FastActionTokenizer:
    """Stands in for the processor ``AutoProcessor.from_pretrained("physical-intelligence/fast",
    trust_remote_code=True)`` returns: ``bpe_tokenizer`` (a PreTrainedTokenizerFast), ``scale``, ``min_token``,
    ``vocab_size``; calling it encodes action chunks."""

    def __init__(self, bpe_tokenizer, scale: float, vocab_size: int, min_token: int, action_dim=None,
                 time_horizon=None):
        self.bpe_tokenizer = bpe_tokenizer
        self.scale = scale
        self.vocab_size = vocab_size
        self.min_token = min_token
        self.action_dim = action_dim
        self.time_horizon = time_horizon

    def coefficients(self, chunk) -> np.ndarray:
        """The quantised DCT coefficients [T, D] of one chunk [T, D]: round(dct(chunk) * scale), half to even."""
        return np.around(_dct(np.asarray(chunk)) * self.scale)

    def coefficient_string(self, chunk) -> str:
        """One character per coefficient, frequency-major: chr(coefficient - min_token), clamped at chr(0)."""
        shifted = np.maximum(self.coefficients(chunk).reshape(-1) - self.min_token, 0).astype(int)
        return "".join(map(chr, shifted))

    def __call__(self, action_chunk) -> list:
        chunks = np.asarray(action_chunk)
        if chunks.ndim == 2:
            chunks = chunks[None]
        if chunks.ndim != 3:
            raise ValueError(f"expected actions [T, D] or [B, T, D], got {list(chunks.shape)}")
        return [self.bpe_tokenizer(self.coefficient_string(chunk))["input_ids"] for chunk in chunks]


def load_fast_tokenizer(directory: Path) -> FastActionTokenizer:
    from transformers import PreTrainedTokenizerFast

    config = json.loads((directory / FAST_PROCESSOR_CONFIG).read_text())
    bpe = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    return FastActionTokenizer(bpe, config["scale"], config["vocab_size"], config["min_token"],
                               action_dim=config.get("action_dim"), time_horizon=config.get("time_horizon"))


# --------------------------------------------------------------------------------------------------------------
# Loading offline

PALIGEMMA_DEFAULT = "google/paligemma-3b-pt-224"  # ActionTokenizerProcessorStep's, which LeRobot does not save


@contextlib.contextmanager
def hub_stand_ins(checkpoint: Path, config):
    """While LeRobot builds or loads the policy and its processors, answer its AutoTokenizer and AutoProcessor
    calls for the config's two tokenizer names with the stand-ins in ``checkpoint``, and refuse any other name.

    PI0FastPolicy imports both from ``transformers`` when it is constructed (LeRobot 0.6: when its module is
    imported), the processor steps use the names lerobot.processor.tokenizer_processor imported, so every place
    is patched, and restored afterwards.
    """
    import transformers
    from lerobot.processor import tokenizer_processor

    text_names = {config.text_tokenizer_name, PALIGEMMA_DEFAULT}

    def tokenizer_from_pretrained(name, *args, **kwargs):
        if name not in text_names or args:
            raise ValueError(f"no offline stand-in for the tokenizer {name!r} (the checkpoint has {text_names})")
        return load_text_tokenizer(checkpoint, **kwargs)

    def processor_from_pretrained(name, *args, **kwargs):
        if name != config.action_tokenizer_name or args:
            raise ValueError(f"no offline stand-in for the processor {name!r} "
                             f"(the checkpoint has {config.action_tokenizer_name!r})")
        return load_fast_tokenizer(checkpoint / FAST_DIR)

    stand_ins = {
        "AutoTokenizer": SimpleNamespace(from_pretrained=tokenizer_from_pretrained),
        "AutoProcessor": SimpleNamespace(from_pretrained=processor_from_pretrained),
    }
    from lerobot.policies.pi0_fast import modeling_pi0_fast

    # LeRobot 0.6's modeling module holds its own references to both (0.4's imports them from transformers)
    saved = [(module, name, getattr(module, name)) for module in (transformers, tokenizer_processor, modeling_pi0_fast)
             for name in stand_ins if getattr(module, name, None) is not None]
    for module, name, _ in saved:
        setattr(module, name, stand_ins[name])
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def apply_dims(dims: dict) -> None:
    """LeRobot's π0-FAST built at the sizes of ``dims`` (lerobot_pi0.patch_model_dims on its modeling module)."""
    from lerobot.policies.pi0_fast import modeling_pi0_fast

    patch_model_dims(modeling_pi0_fast, dims, set_image_size=True)


def read_dims(checkpoint: Path) -> dict:
    path = checkpoint / DIMS_FILE
    if not path.exists():
        raise SystemExit(f"{checkpoint} has no {DIMS_FILE}: LeRobot would build π0-FAST at its real sizes with "
                         f"tokenizers from the Hugging Face Hub, which this offline reference cannot reach; only "
                         f"checkpoints written by make-checkpoint can be run")
    dims = json.loads(path.read_text())
    if dims.get("format") != 1 or dims.get("policy") != POLICY_TYPE:
        raise ValueError(f"{path}: not a format 1 {POLICY_TYPE} sidecar")
    return dims


def load_config(checkpoint: Path):
    install_torchvision_placeholder()
    importlib.import_module("lerobot.policies")  # registers the policies' config classes with PreTrainedConfig
    from lerobot.configs.policies import PreTrainedConfig

    config = PreTrainedConfig.from_pretrained(checkpoint)
    if config.type != POLICY_TYPE:
        raise SystemExit(f"{checkpoint} holds a {config.type!r} policy, not {POLICY_TYPE!r}")
    return config


def load_reference(checkpoint: Path, config):
    """The policy, loaded by LeRobot from the checkpoint at the sizes of its tiny_dims.json, its pre and post
    processors, and the PaliGemma stand-in as the preprocessor's tokenizer step loads it."""
    import torch
    from lerobot.policies.pi0_fast.modeling_pi0_fast import PI0FastPolicy  # (its package registers the state step)
    from safetensors.torch import load_file

    apply_dims(read_dims(checkpoint))
    with hub_stand_ins(checkpoint, config):
        policy = PI0FastPolicy.from_pretrained(checkpoint)
        policy.eval()
        verify_weights(policy, load_file(checkpoint / "model.safetensors"))
        tokenizer = load_text_tokenizer(checkpoint)
        preprocessor, postprocessor = load_processors(checkpoint, tokenizer)
    torch.set_grad_enabled(False)
    return policy, preprocessor, postprocessor, tokenizer


# --------------------------------------------------------------------------------------------------------------
# make-checkpoint

CHECKPOINT_DEFAULTS = {
    "seed": 0,
    "vlm_width": 32,  # the 257152 x width embedding is most of the checkpoint
    "depth": 2,
    "vlm_mlp_dim": 64,
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 16,  # 4 x 16 = 64 != 32: q_proj and o_proj are not square
    "vision_width": 32,
    "vision_depth": 2,
    "vision_heads": 4,
    "vision_mlp_dim": 64,
    "image_size": 56,
    "cameras": ["base"],
    "state_dim": 8,
    "action_dim": 6,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "chunk_size": 10,
    "n_action_steps": None,  # None: chunk_size
    "tokenizer_max_length": None,  # None: LeRobot's (200)
    "max_action_tokens": None,  # None: LeRobot's (256)
    "max_decoding_steps": None,  # None: LeRobot's (256)
    "fast_skip_tokens": None,  # None: LeRobot's (128)
    "validate_action_token_prefix": None,  # None: LeRobot's (true)
    "use_kv_cache": None,  # None: LeRobot's (true)
    "state_norm": "MEAN_STD",  # π0-FAST's default
    "action_norm": "MEAN_STD",
    "dtype": "float32",
}
LEROBOT_DEFAULTS = ("tokenizer_max_length", "max_action_tokens", "max_decoding_steps", "fast_skip_tokens",
                    "validate_action_token_prefix", "use_kv_cache")


def validate_options(o: dict) -> None:
    problems = shape_problems(o)
    if o["image_size"] % PATCH_SIZE:
        problems.append(f"image_size must be a multiple of {PATCH_SIZE}")
    if o["head_dim"] % 2:
        problems.append("head_dim must be even (RoPE)")
    for key in ("tokenizer_max_length", "max_action_tokens", "max_decoding_steps"):
        if o[key] is not None and o[key] < 1:
            problems.append(f"{key} must be positive")
    skip = o["fast_skip_tokens"]
    if skip is not None and not 0 <= skip <= SEG_TOKENS + LOC_TOKENS + 1000:
        problems.append("fast_skip_tokens must be in 0..2152 (the FAST ids must stay above the prompt pieces)")
    for key in ("validate_action_token_prefix", "use_kv_cache"):
        if o[key] is not None and not isinstance(o[key], bool):
            problems.append(f"{key} must be true or false")
    if o["dtype"] not in ("float32", "bfloat16"):
        problems.append("dtype must be float32 or bfloat16")
    if problems:
        raise SystemExit("; ".join(problems))


def dims_from_options(o: dict) -> dict:
    return {
        "format": 1,
        "seed": o["seed"],
        "vocab_size": VOCAB_SIZE,
        "policy": POLICY_TYPE,
        "vlm": gemma_dims(o, "gemma_2b", o["vlm_width"], o["vlm_mlp_dim"]),
        "vision": vision_dims(o),
    }


def write_stand_ins(out: Path, fast_skip_tokens: int) -> dict:
    """Both tokenizer stand-ins into the checkpoint directory; returns the sidecar's "tokenizers" entry."""
    fast = build_fast_tokenizer(out / FAST_DIR)
    top = VOCAB_SIZE - 1 - fast_skip_tokens
    fast.update(fast_skip_tokens=fast_skip_tokens, paligemma_id_of_fast_0=top,
                paligemma_id_of_fast_last=top - (FAST_VOCAB_SIZE - 1))
    return {"text": build_text_tokenizer(out), "fast": fast}


def make_checkpoint(args) -> dict:
    """Build π0-FAST at the small sizes, randomise it and save it with LeRobot's own save_pretrained, beside its pre
    and post processors (with the dataset statistics every normalisation mode needs), the tokenizer stand-ins and
    tiny_dims.json."""
    import torch

    opts = checkpoint_options(args, CHECKPOINT_DEFAULTS, validate_options)
    semantics = prepare_lerobot(args.transformers_shim)
    from lerobot.policies.pi0_fast.configuration_pi0_fast import PI0FastConfig
    from lerobot.policies.pi0_fast.modeling_pi0_fast import PI0FastPolicy
    from lerobot.policies.pi0_fast.processor_pi0_fast import make_pi0_fast_pre_post_processors

    size = opts["image_size"]
    extra = {key: opts[key] for key in LEROBOT_DEFAULTS if opts[key] is not None}
    config = PI0FastConfig(
        dtype=opts["dtype"],
        chunk_size=opts["chunk_size"],
        n_action_steps=opts["n_action_steps"],
        max_state_dim=opts["max_state_dim"],
        max_action_dim=opts["max_action_dim"],
        image_resolution=(size, size),
        **feature_config(opts),
        **extra,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = dims_from_options(opts)
    dims["tokenizers"] = write_stand_ins(out, config.fast_skip_tokens)
    apply_dims(dims)
    with hub_stand_ins(out, config):
        torch.manual_seed(opts["seed"])
        policy = PI0FastPolicy(config)
        randomize_weights(policy, opts["seed"])
        preprocessor, postprocessor = make_pi0_fast_pre_post_processors(config, dataset_stats=dataset_stats(opts))
    save_checkpoint(out, policy, preprocessor, postprocessor, dims)
    return {
        "checkpoint": str(out),
        "policy": POLICY_TYPE,
        "semantics": semantics,
        "image_tokens": dims["vision"]["num_image_tokens"] * len(opts["cameras"]),
        "tokenizers": dims["tokenizers"],
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
    }


# --------------------------------------------------------------------------------------------------------------
# Generation and detokenisation, observed


class Observed:
    """Records what LeRobot's π0-FAST generates and detokenises without changing it: the sampler's return value,
    the margin between the two largest logits of each step (a forward hook on lm_head, which only the samplers
    call), the FAST ids detokenize_actions hands decode_actions_with_fast, and LeRobot's warnings (a decode that
    fell back to zeros logs "Error decoding tokens")."""

    def __init__(self, policy):
        self.policy = policy
        self.tokens = self.fast_ids = self.fell_back = self.sampler = self.exception = None
        self.warnings = []
        self.margins = []
        model = policy.model
        for name in ("sample_actions_fast_kv_cache", "sample_actions_fast"):
            setattr(model, name, self._recording(getattr(model, name), name))
        self._hook = model.paligemma_with_expert.paligemma.lm_head.register_forward_hook(self._margin)
        decode = policy.decode_actions_with_fast

        def decode_actions_with_fast(token_ids, *args, **kwargs):
            # Row by row (LeRobot decodes each row on its own and stacks them) to tell which rows fell back.
            self.fast_ids = [[int(i) for i in ids] for ids in token_ids]
            self.fell_back, rows = [], []
            for ids in token_ids:
                seen = len(self.warnings)
                rows.append(decode([ids], *args, **kwargs)[0])
                self.fell_back.append(any("Error decoding tokens" in w for w in self.warnings[seen:]))
            return np.stack(rows)

        policy.decode_actions_with_fast = decode_actions_with_fast

    def _recording(self, sample, name):
        def sampler(*args, **kwargs):
            self.sampler = name
            self.margins = []
            self.tokens = sample(*args, **kwargs)
            return self.tokens

        return sampler

    def stop_margins(self):
        """Remove the lm_head hook (its top-2 over the vocabulary each step would count in timings)."""
        self._hook.remove()

    def _margin(self, module, inputs, logits):
        top = logits[:, -1].float().topk(2, dim=-1).values
        self.margins.append([float(m) for m in top[:, 0] - top[:, 1]])

    @contextlib.contextmanager
    def capturing_warnings(self):
        observed = self

        class Handler(logging.Handler):
            def emit(self, record):
                observed.warnings.append(record.getMessage()[:300])

        handler = Handler(level=logging.WARNING)
        root = logging.getLogger()
        root.addHandler(handler)
        try:
            yield
        finally:
            root.removeHandler(handler)

    def call(self, function, *args, **kwargs):
        """``function(*args, **kwargs)`` -> (result or None, error text or None), the exception kept as
        ``self.exception``."""
        self.exception = None
        with self.capturing_warnings():
            try:
                return function(*args, **kwargs), None
            except Exception as exc:  # noqa: BLE001  (reported in the result, not hidden)
                self.exception = exc
                return None, f"{type(exc).__name__}: {str(exc)[:400]}"


def token_report(tokens: list, tokenizer, fast_skip_tokens: int) -> dict:
    """Where the markers are in one generated id sequence and what its pieces are."""
    pieces = tokenizer.convert_ids_to_tokens(tokens)
    top = tokenizer.vocab_size - 1 - fast_skip_tokens

    def first(piece):
        return pieces.index(piece) if piece in pieces else None

    return {
        "tokens": tokens,
        "pieces": pieces,
        "action_prefix": pieces[:2] == ["Action", ":"],
        "first_end_of_action": first(END_OF_ACTION),
        "first_eos": first(tokenizer.eos_token),
        "in_fast_range": sum(top - FAST_VOCAB_SIZE < t <= top for t in tokens),
    }


def margin_report(observed: Observed) -> dict:
    """The generation's logit margins (largest minus second largest logit, step by step, first batch row): a
    greedy token another implementation may legitimately flip has a margin within its rounding."""
    margins = [step[0] for step in observed.margins]
    return {"logit_margins": margins, "min_logit_margin": min(margins) if margins else None}


def decode_report(observed: Observed, policy, error: str | None) -> dict:
    """What detokenize_actions made of the ids: outcome, the FAST ids and the coefficient count of each row."""
    report = {
        "validate_action_token_prefix": bool(policy.config.validate_action_token_prefix),
        "outcome": "raised" if error else "actions",
        "error": error,
        "warnings": observed.warnings,
    }
    if observed.fast_ids is not None:
        bpe = policy.action_tokenizer.bpe_tokenizer
        counts = []
        for ids in observed.fast_ids:
            try:
                counts.append(len(bpe.decode(ids)))
            except Exception:  # noqa: BLE001  (LeRobot then decodes zeros; its warning says so)
                counts.append(None)
        report.update(
            fast_ids=observed.fast_ids,
            coefficients=counts,
            expected_coefficients=policy.config.n_action_steps * policy.config.output_features["action"].shape[0],
            fell_back_to_zeros=observed.fell_back,
        )
    return report


# --------------------------------------------------------------------------------------------------------------
# run


def read_inputs(path: Path, config) -> dict:
    data = np.load(path)
    images = {}
    for key in config.image_features:
        if key in data.files:
            img = data[key]
            if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
                raise ValueError(f"{key}: expected uint8 HxWx3, got {img.dtype} {img.shape}")
            images[key] = img
    if not images:
        raise ValueError(f"{path} has none of the cameras {list(config.image_features)}")
    extra = sorted(set(data.files) - set(images) - {"state"})
    if extra:
        raise ValueError(f"{path}: unexpected arrays {extra}")
    state = data["state"].astype(np.float32).reshape(-1)
    if state.shape[0] != config.input_features["observation.state"].shape[0]:
        raise ValueError(f"state has {state.shape[0]} values, the checkpoint expects "
                         f"{config.input_features['observation.state'].shape[0]}")
    return {"images": images, "state": state}


def apply_run_overrides(policy, args) -> None:
    if args.temperature is not None:
        policy.config.temperature = float(args.temperature)
    if args.validate_prefix is not None:
        policy.config.validate_action_token_prefix = args.validate_prefix == "on"
    if args.kv_cache is not None:
        policy.config.use_kv_cache = args.kv_cache == "on"


def run(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    semantics = prepare_lerobot(args.transformers_shim)
    from lerobot.policies.utils import prepare_observation_for_inference

    checkpoint = Path(args.checkpoint)
    config = load_config(checkpoint)
    inputs = read_inputs(Path(args.inputs), config)
    policy, preprocessor, postprocessor, tokenizer = load_reference(checkpoint, config)
    apply_run_overrides(policy, args)
    observed = Observed(policy)

    observation = {key: img.copy() for key, img in inputs["images"].items()}
    observation["observation.state"] = inputs["state"].copy()
    with torch.inference_mode():
        observation = prepare_observation_for_inference(observation, torch.device("cpu"), task=args.task,
                                                        robot_type="")
        batch = preprocessor(observation)
        torch.manual_seed(args.seed)
        normalized, error = observed.call(policy.predict_action_chunk, batch)
        if observed.tokens is None:  # generation itself failed: not a detokenisation outcome to report
            raise observed.exception
        actions = postprocessor(normalized.clone()) if normalized is not None else None
    prompts = batch["task"]
    if not isinstance(prompts, list) or len(prompts) != 1:
        raise RuntimeError(f"the tokenizer step was not handed one prompt (got {prompts!r})")
    ids, mask = batch[LANG_TOKENS][0], batch[LANG_MASK][0]
    tokens = [int(t) for t in observed.tokens[0]]
    result = {
        "policy": POLICY_TYPE,
        "semantics": semantics,
        "prompt": prompts[0],
        "prompt_ids": [int(i) for i in ids[mask]],
        "prompt_ids_untruncated": len(tokenizer(prompts[0])["input_ids"]),
        "lang_padded_to": int(mask.shape[0]),
        "appended_bos_id": int(policy._paligemma_tokenizer.bos_token_id),
        "sampler": observed.sampler,
        "temperature": float(policy.config.temperature),
        "max_decoding_steps": int(policy.config.max_decoding_steps),
        **token_report(tokens, tokenizer, policy.config.fast_skip_tokens),
        **margin_report(observed),
        **decode_report(observed, policy, error),
    }
    if actions is not None:
        result["actions_shape"] = list(actions.shape[1:])
    if args.out:
        arrays = {
            "prompt": np.array(prompts[0]),
            "prompt_ids": ids[mask].numpy().astype(np.int64),
            "lang_tokens": ids.numpy().astype(np.int64),
            "lang_mask": mask.numpy(),
            "state_normalized": batch["observation.state"][0].numpy().astype(np.float32),
            "tokens": np.array(tokens, dtype=np.int64),
        }
        if actions is not None:
            arrays.update(actions=actions[0].numpy().astype(np.float32),
                          actions_normalized=normalized[0].numpy().astype(np.float32))
        np.savez(args.out, **arrays)
        result["out"] = str(args.out)
    if args.time:
        observed.stop_margins()
        result.update(time_calls(policy, batch, args.time, args.seed))
    return result


def time_calls(policy, batch, calls: int, seed: int) -> dict:
    """The wall time of ``calls`` predict_action_chunk calls (a detokenisation that raises counts too)."""
    import torch

    times = []
    with torch.inference_mode():
        for _ in range(calls):
            torch.manual_seed(seed)
            start = time.perf_counter()
            try:
                policy.predict_action_chunk(batch)
            except AssertionError:
                pass
            times.append((time.perf_counter() - start) * 1e3)
    return {"calls": calls, "threads": torch.get_num_threads(), "median_ms": statistics.median(times),
            "min_ms": min(times), "max_ms": max(times)}


# --------------------------------------------------------------------------------------------------------------
# decode and encode


def read_tokens(path: Path) -> np.ndarray:
    """ids.json (a list, a list of lists, or {"tokens": ...} as run and encode print) or ids.npy, [L] or [B, L]."""
    if path.suffix == ".npy":
        tokens = np.load(path)
    else:
        data = json.loads(path.read_text())
        tokens = np.array(data["tokens"] if isinstance(data, dict) else data)
    if tokens.ndim not in (1, 2) or not tokens.size or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: expected integer token ids [L] or [B, L], got {tokens.dtype} {tokens.shape}")
    return tokens.astype(np.int64)


def decode(args) -> dict:
    import torch

    prepare_lerobot(args.transformers_shim)
    checkpoint = Path(args.checkpoint)
    config = load_config(checkpoint)
    tokens = read_tokens(Path(args.tokens))
    policy, _, postprocessor, _ = load_reference(checkpoint, config)
    if args.validate_prefix is not None:
        policy.config.validate_action_token_prefix = args.validate_prefix == "on"
    observed = Observed(policy)
    batch = torch.from_numpy(tokens if tokens.ndim == 2 else tokens[None])
    action_dim = policy.config.output_features["action"].shape[0]
    normalized, error = observed.call(policy.detokenize_actions, batch, action_horizon=policy.config.n_action_steps,
                                      action_dim=action_dim)
    result = decode_report(observed, policy, error)
    if normalized is not None:
        actions = postprocessor(normalized.clone())
        if tokens.ndim == 1:
            normalized, actions = normalized[0], actions[0]
        result.update(actions_normalized=normalized.tolist(), actions=actions.tolist())
        if args.out:
            np.savez(args.out, actions=actions.numpy().astype(np.float32),
                     actions_normalized=normalized.numpy().astype(np.float32))
            result["out"] = str(args.out)
    return result


def encode(args) -> dict:
    """The ids the model would generate for the normalised actions in --actions: LeRobot's training target
    (ActionTokenizerProcessorStep, built as make_pi0_fast_pre_post_processors builds it from the config) without
    its leading <bos>, cut or padded with <pad> to --length."""
    import torch

    prepare_lerobot(args.transformers_shim)
    checkpoint = Path(args.checkpoint)
    config = load_config(checkpoint)
    read_dims(checkpoint)
    actions = np.load(args.actions)
    if actions.ndim != 2:
        raise ValueError(f"{args.actions}: expected normalised actions [T, D], got {list(actions.shape)}")
    from lerobot.processor import ActionTokenizerProcessorStep

    with hub_stand_ins(checkpoint, config):
        step = ActionTokenizerProcessorStep(
            action_tokenizer_name=config.action_tokenizer_name,
            max_action_tokens=config.max_action_tokens,
            fast_skip_tokens=config.fast_skip_tokens,
            paligemma_tokenizer_name=config.text_tokenizer_name,
        )
    target, mask = step._tokenize_action(torch.from_numpy(actions)[None])
    target, mask = target[0], mask[0]
    if int(target[0]) != step._paligemma_tokenizer.bos_token_id:
        raise RuntimeError("LeRobot's action target does not start with <bos>")
    valid = [int(t) for t in target[1:int(mask.sum())]]
    length = args.length or config.max_decoding_steps
    tokens = (valid + [PAD_ID] * length)[:length]
    fast = step.action_tokenizer
    result = {
        "tokens": tokens,
        "valid": len(valid),
        "truncated": bool(mask.all()) or len(valid) > length,
        "fast_ids": fast(actions)[0],
        "coefficients": fast.coefficients(actions).astype(int).tolist(),
        "fast_skip_tokens": config.fast_skip_tokens,
        "scale": fast.scale,
        "min_token": fast.min_token,
    }
    if args.out:
        np.save(args.out, np.array(tokens, dtype=np.int64))
        result["out"] = str(args.out)
    return result


# --------------------------------------------------------------------------------------------------------------
# check


def smooth_actions(rng: np.random.Generator, steps: int, dims: int) -> np.ndarray:
    t = np.linspace(0.0, 1.0, steps)[:, None]
    return (rng.normal(0, 0.5, dims) * np.cos(np.pi * t * rng.uniform(0.2, 1.5, dims))
            + rng.normal(0, 0.05, (steps, dims))).astype(np.float32)


def check(args) -> dict:
    """Import LeRobot's π0-FAST here, make a minute random one, generate its tokens with and without the KV cache
    (they must agree), and decode an encoded chunk with LeRobot within the quantisation."""
    import lerobot
    import scipy
    import tokenizers
    import torch
    import transformers

    shim = args.transformers_shim
    semantics = prepare_lerobot(shim)
    minute = {
        "vlm_width": 16, "depth": 1, "vlm_mlp_dim": 32, "num_heads": 2, "head_dim": 8, "vision_width": 16,
        "vision_depth": 1, "vision_heads": 2, "vision_mlp_dim": 32, "image_size": 28, "chunk_size": 4,
        "state_dim": 3, "action_dim": 2, "tokenizer_max_length": 64, "max_decoding_steps": 12,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_checkpoint(argparse.Namespace(out=tmp, options=json.dumps(minute), transformers_shim=shim))
        rng = np.random.default_rng(0)
        np.savez(tmp / "in.npz", **{"observation.images.base": rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)},
                 state=rng.normal(size=3).astype(np.float32))
        runs = {}
        for kv in ("on", "off"):
            runs[kv] = run(argparse.Namespace(
                checkpoint=tmp, inputs=tmp / "in.npz", out=tmp / f"out-{kv}.npz", task=DEFAULT_TASK, temperature=None,
                seed=0, validate_prefix="off", kv_cache=kv, time=0, threads=0, transformers_shim=shim))
        actions = smooth_actions(rng, 4, 2)
        np.save(tmp / "actions.npy", actions)
        encoded = encode(argparse.Namespace(checkpoint=tmp, actions=tmp / "actions.npy", length=0, out=None,
                                            transformers_shim=shim))
        (tmp / "ids.json").write_text(json.dumps(encoded))
        decoded = decode(argparse.Namespace(checkpoint=tmp, tokens=tmp / "ids.json", validate_prefix=None, out=None,
                                            transformers_shim=shim))
        with np.load(tmp / "out-on.npz") as out_on, np.load(tmp / "out-off.npz") as out_off:
            same_actions = np.array_equal(out_on["actions"], out_off["actions"])
            shape = out_on["actions"].shape

    on, off = runs["on"], runs["off"]
    if on["sampler"] != "sample_actions_fast_kv_cache" or off["sampler"] != "sample_actions_fast":
        raise SystemExit(f"pi0_fast reference check failed: samplers {on['sampler']}, {off['sampler']}")
    margin_diff = max(abs(a - b) for a, b in zip(on["logit_margins"], off["logit_margins"]))
    if len(on["tokens"]) != 12 or on["tokens"] != off["tokens"] or not same_actions or shape != (4, 2) or \
            len(on["logit_margins"]) != 12 or margin_diff > 1e-4:
        raise SystemExit(f"pi0_fast reference check failed: KV cache {on['tokens']} vs {off['tokens']}, margins "
                         f"apart by {margin_diff}, actions {shape}, equal {same_actions}")
    if not on["prompt"].startswith(f"Task: {DEFAULT_TASK}, State: ") or on["prompt_ids"][0] != BOS_ID:
        raise SystemExit(f"pi0_fast reference check failed: prompt {on['prompt']!r} {on['prompt_ids'][:3]}")
    if decoded["outcome"] != "actions" or decoded["fell_back_to_zeros"] != [False]:
        raise SystemExit(f"pi0_fast reference check failed: decode {decoded}")
    from scipy.fft import dct

    error = np.abs(_dct(np.array(decoded["actions_normalized"], dtype=np.float64)) - dct(
        actions.astype(np.float64), axis=0, norm="ortho")).max()
    if error > 0.5 / FAST_SCALE + 1e-6:
        raise SystemExit(f"pi0_fast reference check failed: round trip off by {error} in DCT space")
    return {
        "pi0_fast_reference": "ok",
        "semantics": semantics,
        "kv_cache_tokens_equal": True,
        "kv_cache_logit_margin_diff": margin_diff,
        "round_trip_dct_error": float(error),
        "random_model": {"action_prefix": on["action_prefix"], "first_end_of_action": on["first_end_of_action"]},
        "lerobot": lerobot.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "scipy": scipy.__version__,
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------------------------------------------


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def main(argv=None) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--transformers-shim",
        choices=("auto", "on", "off"),
        default="auto",
        help="patch the branch's π0 semantics into stock transformers (auto: unless the branch is installed)",
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("check", parents=[common], help="smoke test of the environment")

    mk = sub.add_parser("make-checkpoint", parents=[common], help="save a small random π0-FAST as a LeRobot "
                                                                  "checkpoint, with the tokenizer stand-ins")
    mk.add_argument("--out", required=True, help="checkpoint directory to write")
    mk.add_argument("--options", help="JSON object of the options below (underscored names), or @file.json")
    flags = {
        "seed": int, "vlm_width": int, "depth": int, "vlm_mlp_dim": int, "num_heads": int, "num_kv_heads": int,
        "head_dim": int, "vision_width": int, "vision_depth": int, "vision_heads": int, "vision_mlp_dim": int,
        "image_size": int, "cameras": str, "state_dim": int, "action_dim": int, "max_state_dim": int,
        "max_action_dim": int, "chunk_size": int, "n_action_steps": int, "tokenizer_max_length": int,
        "max_action_tokens": int, "max_decoding_steps": int, "fast_skip_tokens": int,
        "validate_action_token_prefix": _bool, "use_kv_cache": _bool, "state_norm": str, "action_norm": str,
        "dtype": str,
    }
    notes = {
        "cameras": "comma-separated; features observation.images.<name>, [3, image_size, image_size]",
        "n_action_steps": "default chunk_size; also the horizon LeRobot decodes the FAST tokens to",
        "tokenizer_max_length": "default LeRobot's 200",
        "max_action_tokens": "default LeRobot's 256 (training targets; encode cuts there)",
        "max_decoding_steps": "default LeRobot's 256 (tokens generated, all of them)",
        "fast_skip_tokens": "default LeRobot's 128",
        "validate_action_token_prefix": "default LeRobot's true",
        "use_kv_cache": "default LeRobot's true",
        "state_norm": f"one of {', '.join(NORM_MODES)}",
        "action_norm": f"one of {', '.join(NORM_MODES)}",
        "dtype": "float32 or bfloat16",
    }
    add_option_flags(mk, CHECKPOINT_DEFAULTS, flags, notes)

    on_off = ("on", "off")
    rn = sub.add_parser("run", parents=[common], help="generate one chunk with LeRobot's π0-FAST")
    rn.add_argument("--checkpoint", required=True, help="checkpoint directory written by make-checkpoint")
    rn.add_argument("--inputs", required=True, help=".npz: observation.images.<cam> uint8 HxWx3, state float32 "
                                                    "[state dim] (raw)")
    rn.add_argument("--task", default=DEFAULT_TASK, help="the task the prompt states (default %(default)r)")
    rn.add_argument("--out", help=".npz to write: prompt, prompt_ids, lang_tokens, lang_mask, state_normalized, "
                                  "tokens [max_decoding_steps], and actions [n_action_steps, action dim], "
                                  "actions_normalized unless the detokenisation raised")
    rn.add_argument("--temperature", type=float, help="default the config's (0: greedy)")
    rn.add_argument("--seed", type=int, default=0, help="torch seed before generating (sampling at temperature > 0)")
    rn.add_argument("--validate-prefix", choices=on_off, help="validate_action_token_prefix (default the config's)")
    rn.add_argument("--kv-cache", choices=on_off, help="use_kv_cache (default the config's)")
    rn.add_argument("--time", type=int, default=0, metavar="N", help="also time N calls of predict_action_chunk")
    rn.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")

    dc = sub.add_parser("decode", parents=[common], help="LeRobot's detokenize_actions of given token ids")
    dc.add_argument("--checkpoint", required=True, help="checkpoint directory written by make-checkpoint")
    dc.add_argument("--tokens", required=True, help="ids.json (a list, a list of lists, or {\"tokens\": ...}) or "
                                                    "ids.npy: [L] or [B, L] PaliGemma ids as generated")
    dc.add_argument("--validate-prefix", choices=on_off, help="validate_action_token_prefix (default the config's)")
    dc.add_argument("--out", help=".npz to write: actions, actions_normalized")

    ec = sub.add_parser("encode", parents=[common], help="the ids the model would emit for given actions")
    ec.add_argument("--checkpoint", required=True, help="checkpoint directory written by make-checkpoint")
    ec.add_argument("--actions", required=True, help=".npy: normalised actions [T, D]")
    ec.add_argument("--length", type=int, default=0, help="ids to return (default max_decoding_steps)")
    ec.add_argument("--out", help=".npy to write the ids to")

    args = parser.parse_args(argv)
    commands = {"check": check, "make-checkpoint": make_checkpoint, "run": run, "decode": decode, "encode": encode}
    print_result(commands[args.command], args)


if __name__ == "__main__":
    main()
