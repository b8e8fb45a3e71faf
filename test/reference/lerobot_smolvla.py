#!/usr/bin/env python3
"""LeRobot's SmolVLA (``lerobot.policies.smolvla``) as the reference the project's SmolVLA is compared with, in
release 0.4.4 or 0.6.1: whichever the interpreter has.

Run it with the interpreter of ``.venv-pi0ref`` (``make pi0ref-venv``): torch 2.13 CPU, stock transformers
4.53.2 and lerobot 0.4.4 installed without its dependencies; or of ``.venv-lerobot06`` (``make lerobot06-venv``:
LeRobot 0.6.1, transformers 5.5.4). SmolVLA runs on stock transformers, so unlike
lerobot_pi0.py nothing in transformers is patched; the helpers shared with π0 (torchvision placeholder, dataset
statistics, weight randomisation, processor loading, inputs, Real-Time Chunking) are imported from lerobot_pi0.py.

Subcommands
    check            import LeRobot's SmolVLA here and run a minute model with two cameras once, and its
                     tokenizer step once (the venv's smoke test)
    make-checkpoint  build a small SmolVLA with random weights and save it as a checkpoint directory of the
                     installed LeRobot
    run              load such a checkpoint with LeRobot and compute one action chunk from an .npz of inputs
                     (with --rtc, also the chunks LeRobot's Real-Time Chunking guides towards given leftovers)
    tokens           the language tokens LeRobot's SmolVLA preprocessor (the checkpoint's policy_preprocessor.json)
                     makes of a task with a given tokenizer

Building offline
    SmolVLMWithExpertModel takes the VLM's sizes from ``AutoConfig.from_pretrained(vlm_model_name)`` and two token
    ids from ``AutoProcessor.from_pretrained(vlm_model_name).tokenizer``, both on the Hub, and nothing in
    LeRobot's config.json describes the VLM. make-checkpoint therefore writes ``smolvla_dims.json`` beside the
    checkpoint, and run (like make-checkpoint) replaces the two in ``lerobot.policies.smolvla.smolvlm_with_expert``
    by stand-ins answering from it before LeRobot builds the policy. The policy is always built with
    load_vlm_weights=False (the weights come from model.safetensors). A checkpoint without smolvla_dims.json
    would be SmolVLM2-500M at its real sizes, whose config and processor only the Hub has: run refuses it.

smolvla_dims.json
    {"format": 1, "seed": int, "vlm_model_name": str (config.json's, whose config this stands in for),
     "text_config":   {"model_type": "llama", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "vocab_size"},
     "vision_config": {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                       "patch_size", "image_size", "layer_norm_eps"},
     "scale_factor": int, "fake_image_token_id": int, "global_image_token_id": int,
     "image_tokens": int (per camera, (image_size / patch_size / scale_factor) ** 2; derived, for reading)}
    text_config and vision_config use the key names of transformers' SmolVLMConfig (the real VLM's config.json);
    text_config.num_hidden_layers is the number of text layers in the checkpoint (num_vlm_layers). RoPE's base is
    not recorded: LeRobot's own rotary code uses 10000 whatever the config says.

What run computes
    The observation goes the way lerobot-record's predict_action sends it: uint8 HxWx3 images to float [0, 1] CHW,
    a batch dimension, then the checkpoint's preprocessor (batching, "\\n" appended to the task, the tokenizer step,
    the normaliser). The tokenizer is not loaded: the tokenizer step returns the ids of the inputs' lang_tokens,
    cut to tokenizer_max_length and padded as the saved step asks (SmolVLA's default padding="longest" leaves
    one prompt unpadded; with "max_length" it pads on the right with id 0 and mask 0 -- padded tokens are masked
    everywhere, so the pad id never changes the actions). ``SmolVLAPolicy.predict_action_chunk`` returns all
    chunk_size steps (not n_action_steps) of the first action_dim dimensions, normalised; the postprocessor
    un-normalises them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from lerobot_pi0 import (  # noqa: E402  (also sets HF_HUB_OFFLINE: nothing here may reach the Hub)
    DEFAULT_TASK,
    NORM_MODES,
    PretokenizedPrompt,
    add_option_flags,
    add_run_flags,
    compute_chunks,
    checkpoint_options,
    dataset_stats,
    feature_config,
    install_torchvision_placeholder,
    load_processors,
    pi0_weight_value,
    print_result,
    randomize_weights,
    save_checkpoint,
    shape_problems,
    read_inputs,
    read_rtc_cases,
    tokenizer_not_loaded,
    write_outputs,
)

DIMS_FILE = "smolvla_dims.json"
POLICY_TYPE = "smolvla"
LANG_TOKENS = "observation.language.tokens"
LANG_MASK = "observation.language.attention_mask"

# --------------------------------------------------------------------------------------------------------------
# The VLM's sizes


def vlm_config(dims: dict):
    """transformers' SmolVLMConfig of the sizes in ``dims`` (the smolvla_dims.json format)."""
    from transformers import SmolVLMConfig

    return SmolVLMConfig(
        vision_config=dict(dims["vision_config"]),
        text_config={"model_type": "llama", **dims["text_config"]},
        scale_factor=dims["scale_factor"],
    )


def apply_dims(dims: dict) -> None:
    """Make LeRobot build SmolVLA's VLM at the sizes of ``dims`` without reaching the Hub.

    SmolVLMWithExpertModel looks up AutoConfig, AutoProcessor and AutoModelForImageTextToText in its module at call
    time; the first two are replaced by stand-ins answering for ``dims["vlm_model_name"]`` only, the third (the
    pretrained VLM weights, load_vlm_weights=True) by one that refuses.
    """
    from lerobot.policies.smolvla import smolvlm_with_expert

    name = dims["vlm_model_name"]
    processor = SimpleNamespace(tokenizer=SimpleNamespace(fake_image_token_id=dims["fake_image_token_id"],
                                                          global_image_token_id=dims["global_image_token_id"]))

    def known(model_id):
        if model_id != name:
            raise ValueError(f"{DIMS_FILE} describes {name!r}, LeRobot asked for {model_id!r}")

    def config_from_pretrained(model_id, *args, **kwargs):
        known(model_id)
        return vlm_config(dims)

    def processor_from_pretrained(model_id, *args, **kwargs):
        known(model_id)
        return processor

    def no_weights(model_id, *args, **kwargs):
        raise RuntimeError(f"the pretrained weights of {model_id!r} are not available offline "
                           f"(build with load_vlm_weights=False)")

    smolvlm_with_expert.AutoConfig = SimpleNamespace(from_pretrained=config_from_pretrained)
    smolvlm_with_expert.AutoProcessor = SimpleNamespace(from_pretrained=processor_from_pretrained)
    smolvlm_with_expert.AutoModelForImageTextToText = SimpleNamespace(from_pretrained=no_weights)


def read_dims(checkpoint: Path, config) -> dict:
    path = checkpoint / DIMS_FILE
    if not path.exists():
        raise SystemExit(
            f"{checkpoint} has no {DIMS_FILE}: LeRobot would build {config.vlm_model_name!r} at its real sizes, "
            f"whose config and processor it fetches from the Hugging Face Hub, which this offline reference "
            f"cannot reach; only checkpoints written by make-checkpoint can be run")
    dims = json.loads(path.read_text())
    if dims.get("format") != 1:
        raise ValueError(f"{path}: unknown format {dims.get('format')!r}")
    if dims["vlm_model_name"] != config.vlm_model_name:
        raise ValueError(f"{path} describes {dims['vlm_model_name']!r}, config.json names {config.vlm_model_name!r}")
    if config.load_vlm_weights:
        raise ValueError(f"{checkpoint}: load_vlm_weights is set, which loads the VLM from the Hub")
    return dims


def image_tokens(image_size: int, patch_size: int, scale_factor: int) -> int:
    return (image_size // patch_size // scale_factor) ** 2


# --------------------------------------------------------------------------------------------------------------
# make-checkpoint

CHECKPOINT_DEFAULTS = {
    "seed": 0,
    "cameras": ["base", "wrist"],
    "image_size": 48,
    "patch_size": 8,
    "scale_factor": 2,  # 6x6 patches -> 3x3 = 9 tokens per camera
    "vision_width": 32,
    "vision_depth": 2,
    "vision_heads": 4,
    "vision_mlp_dim": 64,
    "vision_layer_norm_eps": 1e-6,
    "vlm_width": 48,
    "num_vlm_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,  # 4 x 16 = 64 != 48: q_proj and o_proj are not square
    "vlm_mlp_dim": 96,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "expert_width_multiplier": 0.75,
    "num_expert_layers": -1,
    "self_attn_every_n_layers": 2,
    "attention_mode": "cross_attn",
    "state_dim": 7,
    "action_dim": 5,
    "max_state_dim": 32,
    "max_action_dim": 32,
    "chunk_size": 10,
    "n_action_steps": None,  # None: chunk_size
    "num_steps": 10,
    "tokenizer_max_length": 48,
    "pad_language_to": "longest",
    "prefix_length": -1,
    "add_image_special_tokens": False,
    "state_norm": "MEAN_STD",
    "action_norm": "MEAN_STD",
}
ATTENTION_MODES = ("cross_attn", "self_attn")
PADDINGS = ("longest", "max_length")


def validate_options(o: dict) -> None:
    problems = shape_problems(o)
    side = o["image_size"] // o["patch_size"] if o["patch_size"] > 0 else 0
    if o["patch_size"] < 1 or o["image_size"] % o["patch_size"]:
        problems.append("image_size must be a multiple of patch_size")
    elif o["scale_factor"] < 1 or side % o["scale_factor"]:
        problems.append("image_size / patch_size must be a multiple of scale_factor")
    if o["head_dim"] % 2:
        problems.append("head_dim must be even (RoPE)")
    expert_width = int(o["vlm_width"] * o["expert_width_multiplier"])
    if expert_width < 2 or expert_width % 2:
        problems.append("int(vlm_width * expert_width_multiplier) must be even and positive (the time embedding)")
    if o["num_vlm_layers"] < 1:
        problems.append("num_vlm_layers must be positive")
    if o["num_expert_layers"] > 0 and o["num_expert_layers"] != o["num_vlm_layers"]:
        problems.append("num_expert_layers must be <= 0 or num_vlm_layers (an expert layer for every VLM layer)")
    if o["attention_mode"] not in ATTENTION_MODES:
        problems.append(f"attention_mode must be one of {', '.join(ATTENTION_MODES)}")
    if o["pad_language_to"] not in PADDINGS:
        problems.append(f"pad_language_to must be one of {', '.join(PADDINGS)}")
    if not isinstance(o["add_image_special_tokens"], bool):
        problems.append("add_image_special_tokens must be true or false")
    if o["vocab_size"] < 2:
        problems.append("vocab_size must be at least 2")
    if o["tokenizer_max_length"] < 1:
        problems.append("tokenizer_max_length must be positive")
    if o["num_steps"] < 1:
        problems.append("num_steps must be positive")
    if problems:
        raise SystemExit("; ".join(problems))


def dims_from_options(o: dict, vlm_model_name: str) -> dict:
    return {
        "format": 1,
        "seed": o["seed"],
        "vlm_model_name": vlm_model_name,
        "text_config": {
            "model_type": "llama",
            "hidden_size": o["vlm_width"],
            "num_hidden_layers": o["num_vlm_layers"],
            "num_attention_heads": o["num_heads"],
            "num_key_value_heads": o["num_kv_heads"],
            "head_dim": o["head_dim"],
            "intermediate_size": o["vlm_mlp_dim"],
            "rms_norm_eps": o["rms_norm_eps"],
            "vocab_size": o["vocab_size"],
        },
        "vision_config": {
            "hidden_size": o["vision_width"],
            "num_hidden_layers": o["vision_depth"],
            "num_attention_heads": o["vision_heads"],
            "intermediate_size": o["vision_mlp_dim"],
            "patch_size": o["patch_size"],
            "image_size": o["image_size"],
            "layer_norm_eps": o["vision_layer_norm_eps"],
        },
        "scale_factor": o["scale_factor"],
        "fake_image_token_id": o["vocab_size"] - 2,
        "global_image_token_id": o["vocab_size"] - 1,
        "image_tokens": image_tokens(o["image_size"], o["patch_size"], o["scale_factor"]),
    }


def smolvla_weight_value(module, module_name: str, param_name: str, param, noise):
    """π0's random values (lerobot_pi0.pi0_weight_value: LayerNorm gains 1 + 0.3 N and biases 0.1 N, other biases
    0.1 N, position embeddings 0.5 N, token embeddings N / sqrt(width) as SmolVLA multiplies them by sqrt(width),
    Linear and Conv2d weights N / sqrt(fan_in)), with Llama's RMSNorm gains 1 + 0.3 N: it scales by w, not 1 + w."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if isinstance(module, LlamaRMSNorm):
        return 1.0 + 0.3 * noise
    return pi0_weight_value(module, module_name, param_name, param, noise)


def layer_counts(state: dict) -> dict:
    """How many text, expert and vision layers a SmolVLA state dict holds."""
    prefixes = {
        "text": "model.vlm_with_expert.vlm.model.text_model.layers.",
        "expert": "model.vlm_with_expert.lm_expert.layers.",
        "vision": "model.vlm_with_expert.vlm.model.vision_model.encoder.layers.",
    }
    return {part: len({k[len(p):].split(".")[0] for k in state if k.startswith(p)}) for part, p in prefixes.items()}


def make_checkpoint(args) -> dict:
    """Build SmolVLA at the small sizes, randomise it and save it with LeRobot's own save_pretrained, beside its
    pre/post processors (with the dataset statistics every normalisation mode needs) and smolvla_dims.json."""
    import torch
    from safetensors.torch import load_file

    opts = checkpoint_options(args, CHECKPOINT_DEFAULTS, validate_options)
    install_torchvision_placeholder()
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from lerobot.policies.smolvla.processor_smolvla import make_smolvla_pre_post_processors

    size = opts["image_size"]
    config = SmolVLAConfig(
        chunk_size=opts["chunk_size"],
        n_action_steps=opts["n_action_steps"],
        max_state_dim=opts["max_state_dim"],
        max_action_dim=opts["max_action_dim"],
        resize_imgs_with_padding=(size, size),  # an image of that size is not resampled
        tokenizer_max_length=opts["tokenizer_max_length"],
        pad_language_to=opts["pad_language_to"],
        num_steps=opts["num_steps"],
        load_vlm_weights=False,
        add_image_special_tokens=opts["add_image_special_tokens"],
        attention_mode=opts["attention_mode"],
        prefix_length=opts["prefix_length"],
        num_expert_layers=opts["num_expert_layers"],
        num_vlm_layers=opts["num_vlm_layers"],
        self_attn_every_n_layers=opts["self_attn_every_n_layers"],
        expert_width_multiplier=opts["expert_width_multiplier"],
        **feature_config(opts),
    )
    dims = dims_from_options(opts, config.vlm_model_name)
    apply_dims(dims)
    torch.manual_seed(opts["seed"])
    policy = SmolVLAPolicy(config)
    randomize_weights(policy, opts["seed"], rule=smolvla_weight_value)
    with tokenizer_not_loaded():
        preprocessor, postprocessor = make_smolvla_pre_post_processors(config, dataset_stats=dataset_stats(opts))

    out = Path(args.out)
    save_checkpoint(out, policy, preprocessor, postprocessor, dims, DIMS_FILE)

    layers = layer_counts(load_file(out / "model.safetensors"))
    expected = {"text": opts["num_vlm_layers"], "expert": opts["num_vlm_layers"], "vision": opts["vision_depth"]}
    if layers != expected:
        raise RuntimeError(f"the saved checkpoint holds {layers} layers, expected {expected}")
    return {
        "checkpoint": str(out),
        "policy": POLICY_TYPE,
        "layers": layers,
        "image_tokens": dims["image_tokens"],
        "expert_width": policy.model.vlm_with_expert.expert_hidden_size,
        "files": sorted(p.name for p in out.iterdir()),
    }


# --------------------------------------------------------------------------------------------------------------
# run


def verify_weights(policy, saved: dict) -> None:
    """Fail unless the saved tensors and the policy's are the same set and every one loaded unchanged.

    PreTrainedPolicy.from_pretrained loads with strict=False, which would leave a tensor missing from the file at
    its random initialisation without a word; a reference must not pass with that.
    """
    import torch

    state = policy.state_dict()
    missing = sorted(set(state) - set(saved))
    if missing:
        raise RuntimeError(f"{len(missing)} policy tensors are not in the checkpoint, e.g. {missing[:3]}")
    wrong = [k for k, v in saved.items() if k not in state or not torch.equal(state[k], v.to(state[k].dtype))]
    if wrong:
        raise RuntimeError(f"{len(wrong)} saved tensors did not load, e.g. {wrong[:3]}")


def load_config(checkpoint: Path):
    install_torchvision_placeholder()
    importlib.import_module("lerobot.policies")  # registers the policies' config classes with PreTrainedConfig
    from lerobot.configs.policies import PreTrainedConfig

    config = PreTrainedConfig.from_pretrained(checkpoint)
    if config.type != POLICY_TYPE:
        raise SystemExit(f"{checkpoint} holds a {config.type!r} policy, not {POLICY_TYPE!r}")
    return config


def load_reference(checkpoint: Path, config, lang_tokens: np.ndarray):
    """The policy and its pre/post processors, loaded by LeRobot from the checkpoint directory at the sizes of its
    smolvla_dims.json, and the tokenizer stand-in the preprocessor's tokenizer step was handed."""
    import torch
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy
    from safetensors.torch import load_file

    apply_dims(read_dims(checkpoint, config))
    policy = SmolVLAPolicy.from_pretrained(checkpoint)
    policy.eval()
    verify_weights(policy, load_file(checkpoint / "model.safetensors"))
    tokenizer = PretokenizedPrompt(lang_tokens)
    preprocessor, postprocessor = load_processors(checkpoint, tokenizer)
    torch.set_grad_enabled(False)
    return policy, preprocessor, postprocessor, tokenizer


def run(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = Path(args.checkpoint)
    config = load_config(checkpoint)
    rtc_cases = read_rtc_cases(getattr(args, "rtc", None))
    inputs = read_inputs(Path(args.inputs), config, rtc_cases)
    if inputs["lang_tokens"].ndim != 1 or not len(inputs["lang_tokens"]):
        raise ValueError("lang_tokens must be a non-empty int64 [n]")
    policy, preprocessor, postprocessor, tokenizer = load_reference(checkpoint, config, inputs["lang_tokens"])
    batch, normalized, actions, guided, timing = compute_chunks(policy, preprocessor, postprocessor, inputs,
                                                                rtc_cases, args.task, args.time)
    if not tokenizer.texts or len(tokenizer.texts) != 1:
        raise RuntimeError(f"the tokenizer step was not handed one prompt (got {tokenizer.texts!r})")
    mask = batch[LANG_MASK][0]
    result = {
        "policy": POLICY_TYPE,
        "actions_shape": list(actions.shape[1:]),
        "prompt": tokenizer.texts[0],  # what the ids stand for: --task with LeRobot's "\n"
        "lang_tokens": int(mask.sum()),
        "lang_padded_to": int(mask.shape[0]),
    }
    if args.out:
        write_outputs(args.out, batch, normalized, actions, guided)
        result["out"] = str(args.out)
    if timing:
        result.update(timing)
    return result


# --------------------------------------------------------------------------------------------------------------
# tokens


def load_tokenizer(path: str, pad_token: str | None):
    """A tokenizer.json file as PreTrainedTokenizerFast, or a local tokenizer directory through AutoTokenizer
    (which also reads its tokenizer_config.json, as LeRobot's AutoTokenizer.from_pretrained(vlm_model_name) does).
    Padding needs a pad token; one without gets ``pad_token`` or its id 0. With SmolVLA's padding="longest" and a
    single prompt nothing is padded, so that choice shows only with padding="max_length"."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    source = Path(path)
    if source.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source))
    if pad_token is not None:
        tokenizer.pad_token = pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def tokens(args) -> dict:
    """Run a blank observation with ``args.task`` through the checkpoint's preprocessor, its tokenizer step handed
    the given tokenizer, and report the language tokens it made."""
    import torch

    checkpoint = Path(args.checkpoint)
    config = load_config(checkpoint)
    from lerobot.policies.utils import prepare_observation_for_inference

    tokenizer = load_tokenizer(args.tokenizer, args.pad_token)
    preprocessor, _ = load_processors(checkpoint, tokenizer)
    observation = {key: np.zeros((*feature.shape[1:], feature.shape[0]), np.uint8)
                   for key, feature in config.image_features.items()}
    observation["observation.state"] = np.zeros(config.input_features["observation.state"].shape, np.float32)
    with torch.inference_mode():
        observation = prepare_observation_for_inference(observation, torch.device("cpu"), task=args.task,
                                                        robot_type="")
        batch = preprocessor(observation)
    ids = batch[LANG_TOKENS][0]
    mask = batch[LANG_MASK][0]
    return {
        "task": args.task,
        "prompt": batch["task"][0],
        "ids": [int(i) for i in ids[mask]],
        "attention_mask": [int(m) for m in mask],
        "padded_ids": [int(i) for i in ids],
        "pad_token_id": tokenizer.pad_token_id,
    }


# --------------------------------------------------------------------------------------------------------------
# check

CHECK_TEXTS = ["pick up the red cube", "put the cube in the box", "open the drawer\n", "close it\n"]


def tiny_tokenizer(path: Path) -> Path:
    """A byte-level BPE tokenizer.json trained on a few sentences (the kind SmolVLM2's is), for checking."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CHECK_TEXTS, trainer=trainer)
    tokenizer.save(str(path))
    return path


def check(args) -> dict:
    """Import LeRobot's SmolVLA here and run a minute random model with two cameras once, end to end, and its
    tokenizer step with a small byte-level BPE tokenizer."""
    import lerobot
    import tokenizers
    import torch
    import transformers

    minute = {
        "cameras": "top,wrist", "image_size": 16, "patch_size": 4, "scale_factor": 2, "vision_width": 16,
        "vision_depth": 1, "vision_heads": 2, "vision_mlp_dim": 32, "vlm_width": 32, "num_vlm_layers": 2,
        "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "vlm_mlp_dim": 64, "vocab_size": 300, "chunk_size": 4,
        "num_steps": 2, "state_dim": 3, "action_dim": 2, "tokenizer_max_length": 8,
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        made = make_checkpoint(argparse.Namespace(out=tmp, options=json.dumps(minute)))
        rng = np.random.default_rng(0)
        np.savez(
            tmp / "in.npz",
            **{f"observation.images.{cam}": rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
               for cam in ("top", "wrist")},
            lang_tokens=np.array([5, 100, 200], dtype=np.int64),
            state=rng.normal(size=3).astype(np.float32),
            noise=rng.normal(size=(4, 32)).astype(np.float32),
        )
        result = run(argparse.Namespace(checkpoint=tmp, inputs=tmp / "in.npz", out=tmp / "out.npz", time=0,
                                        threads=0, task=DEFAULT_TASK))
        actions = np.load(tmp / "out.npz")["actions"]
        task = "pick up the red cube"
        tokenized = tokens(argparse.Namespace(checkpoint=tmp, tokenizer=str(tiny_tokenizer(tmp / "tokenizer.json")),
                                              task=task, pad_token=None))
        expected = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp / "tokenizer.json"))(task + "\n")
    if made["image_tokens"] != 4 or made["layers"] != {"text": 2, "expert": 2, "vision": 1}:
        raise SystemExit(f"smolvla reference check failed: checkpoint {made}")
    if actions.shape != (4, 2) or not np.isfinite(actions).all() or result["prompt"] != DEFAULT_TASK + "\n":
        raise SystemExit(f"smolvla reference check failed: actions {actions.shape}, run {result}")
    if tokenized["ids"] != expected["input_ids"][:8] or tokenized["prompt"] != task + "\n":
        raise SystemExit(f"smolvla reference check failed: tokens {tokenized}, expected {expected['input_ids']}")
    return {
        "smolvla_reference": "ok",
        "lerobot": lerobot.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("check", help="smoke test of the environment")

    mk = sub.add_parser("make-checkpoint", help="save a small random SmolVLA as a LeRobot checkpoint")
    mk.add_argument("--out", required=True, help="checkpoint directory to write")
    mk.add_argument("--options", help="JSON object of the options below (underscored names), or @file.json")
    flags = {
        "seed": int, "cameras": str, "image_size": int, "patch_size": int, "scale_factor": int,
        "vision_width": int, "vision_depth": int, "vision_heads": int, "vision_mlp_dim": int,
        "vision_layer_norm_eps": float, "vlm_width": int, "num_vlm_layers": int, "num_heads": int,
        "num_kv_heads": int, "head_dim": int, "vlm_mlp_dim": int, "vocab_size": int, "rms_norm_eps": float,
        "expert_width_multiplier": float, "num_expert_layers": int, "self_attn_every_n_layers": int,
        "attention_mode": str, "state_dim": int, "action_dim": int, "max_state_dim": int, "max_action_dim": int,
        "chunk_size": int, "n_action_steps": int, "num_steps": int, "tokenizer_max_length": int,
        "pad_language_to": str, "prefix_length": int, "state_norm": str, "action_norm": str,
    }
    notes = {
        "cameras": "comma-separated; features observation.images.<name>, [3, image_size, image_size]",
        "scale_factor": "the connector's pixel shuffle; (image_size / patch_size / scale_factor)^2 tokens a camera",
        "num_vlm_layers": "the text layers the checkpoint holds",
        "head_dim": "text and expert attention heads: num_heads x head_dim, num_kv_heads x head_dim",
        "vocab_size": "the last two ids are the fake and global image tokens",
        "num_expert_layers": "<= 0 or num_vlm_layers",
        "attention_mode": f"one of {', '.join(ATTENTION_MODES)}",
        "n_action_steps": "default chunk_size",
        "num_steps": "denoising steps",
        "pad_language_to": f"one of {', '.join(PADDINGS)}",
        "state_norm": f"one of {', '.join(NORM_MODES)}",
        "action_norm": f"one of {', '.join(NORM_MODES)}",
    }
    add_option_flags(mk, CHECKPOINT_DEFAULTS, flags, notes)
    mk.add_argument("--add-image-special-tokens", dest="add_image_special_tokens", action="store_true",
                    default=None, help="config add_image_special_tokens (default off)")

    rn = sub.add_parser("run", help="compute one action chunk with LeRobot's SmolVLA")
    rn.add_argument("--checkpoint", required=True, help="checkpoint directory written by make-checkpoint")
    rn.add_argument("--inputs", required=True, help=".npz: observation.images.<cam> uint8 HxWx3, lang_tokens int64 "
                                                    "[n], state float32 [state dim], noise float32 [chunk, "
                                                    "max_action_dim]")
    rn.add_argument("--task", default=DEFAULT_TASK, help="the task lang_tokens stand for, reported with LeRobot's "
                                                         "\"\\n\" as the result's \"prompt\" (default %(default)r)")
    add_run_flags(rn)

    tk = sub.add_parser("tokens", help="the language tokens LeRobot's SmolVLA preprocessor makes of a task")
    tk.add_argument("--checkpoint", required=True, help="SmolVLA checkpoint directory (its policy_preprocessor.json)")
    tk.add_argument("--tokenizer", required=True, help="tokenizer.json, or a local tokenizer directory")
    tk.add_argument("--task", required=True)
    tk.add_argument("--pad-token", help="pad token to set (default the tokenizer's, else its id 0)")

    args = parser.parse_args(argv)
    print_result({"check": check, "make-checkpoint": make_checkpoint, "run": run, "tokens": tokens}[args.command],
                 args)


if __name__ == "__main__":
    main()
