"""Reading a local Hugging Face checkpoint directory: its config.json and other JSON files, and its
safetensors tensors.

::

    keys = tensor_files(hf_dir, keep=lambda key: key.startswith("model.visual."))   # {key: file}
    for key, tensor in read_tensors(keys):                                            # float32, one at a time
        ...

The tensors are found in the shards named by ``model.safetensors.index.json``, else in
``model.safetensors``, else in every ``*.safetensors`` file of the directory. Errors are ConfigErrors
that name the file or directory.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterator, Mapping

import torch

from ...core.config import ConfigError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_json(path: str) -> dict:
    """The JSON object in ``path``; ConfigError naming the file when it is absent, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return data


def read_config(hf_dir: str) -> tuple[str, dict]:
    """(path, contents) of the checkpoint's config.json; ConfigError when ``hf_dir`` has none."""
    path = os.path.join(hf_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{hf_dir}: not a Hugging Face checkpoint directory (no {CONFIG_FILE}: "
                          f"{path} not found)")
    return path, read_json(path)


def safetensors_files(hf_dir: str, keep: Callable[[str], bool] | None = None) -> list[str]:
    """Paths of the checkpoint's safetensors files. With an index, only the shards holding a tensor that
    ``keep`` accepts (all shards without ``keep``), so a caller reading one part opens only its shards."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({f for key, f in weight_map.items() if keep is None or keep(key)})
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            raise ConfigError(f"{index}: shard files missing: {missing}")
        return [os.path.join(hf_dir, f) for f in files]
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(hf_dir, f) for f in others]
    raise ConfigError(f"{hf_dir}: no safetensors weights ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors)")


def tensor_files(hf_dir: str, keep: Callable[[str], bool] | None = None) -> dict[str, str]:
    """``{tensor key: file}`` for the tensors of the checkpoint that ``keep`` accepts (all without it), in
    file order. Only the file headers are read."""
    from safetensors import safe_open

    found: dict[str, str] = {}
    for path in safetensors_files(hf_dir, keep):
        with safe_open(path, framework="pt") as fh:
            found.update((key, path) for key in fh.keys() if keep is None or keep(key))
    return found


def read_tensors(files: Mapping[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` in float32 for every ``key: file`` of ``files`` (as :func:`tensor_files` gives),
    one tensor at a time and each file opened once."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as fh:
            for key in keys:
                yield key, fh.get_tensor(key).to(torch.float32)


def tensor_shapes(files: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` for every ``key: file`` of ``files``, from the file headers (no tensor is read)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for key, path in files.items():
        by_file.setdefault(path, []).append(key)
    shapes = {}
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as fh:
            for key in keys:
                shapes[key] = tuple(fh.get_slice(key).get_shape())
    return shapes


def copy_checked(params: Mapping[str, torch.nn.Parameter], files: Mapping[str, str], wanted: Mapping[str, str],
                 expected, unexpected, where: str, what: str, hint: str = "") -> None:
    """Copy checkpoint tensors into parameters: ``wanted`` maps a checkpoint key (in ``files``) to a name of
    ``params``. ConfigError naming up to 8 of them when an ``expected`` parameter has no tensor, when there
    are ``unexpected`` checkpoint keys, or when a shape differs (``hint`` says what to do then)."""
    missing = sorted(set(expected) - set(wanted.values()))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
        raise ConfigError(f"{where}: checkpoint does not match {what}: {'; '.join(parts)}")
    with torch.no_grad():
        for key, tensor in read_tensors({key: files[key] for key in wanted}):
            target = params[wanted[key]]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ConfigError(f"{where}: {key} has shape {list(tensor.shape)}, the graphs expect "
                                  f"{list(target.shape)}{f' ({hint})' if hint else ''}")
            target.copy_(tensor)
