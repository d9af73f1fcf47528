"""Tokenize text files into a flat token file for `data.source = "bin"` (the nanoGPT / Megatron layout).

    python launch/tokenize_text.py --tokenizer tokenizer.json --out data/train.bin a.txt b.txt ...
    python launch/tokenize_text.py --tokenizer KIMI_K25_DIR --trust-remote-code --workers 8 --out ... files

Uses a local Hugging Face `tokenizer.json` (the `tokenizers` package), or a tokenizer directory that
`transformers.AutoTokenizer` loads (Kimi's tiktoken tokenizer needs `--trust-remote-code`):
runtime/data/tokenizer_dir.py; nothing is downloaded. `--workers N` tokenizes on N processes, with the same
output for any N. Writes
the token ids of all files, in order, as one flat array: uint16 when every id fits (vocab <= 65536),
else uint32, plus a sidecar `<out>.json` with {"dtype", "vocab_size", "num_tokens"} that the loader
reads (`data.dtype = "auto"`). With `--eos TOKEN`, that token's id follows each file (document
boundary). Files are read in chunks that end at line breaks, so memory stays bounded; the output
appears atomically (written to `<out>.tmp`, then renamed; a failure removes the `.tmp`). Refused, with
one line and exit status 2: `--out` (or its sidecar) naming an input or the tokenizer, `--out` a
directory or in a missing one, a missing or unreadable `tokenizer.json`, input that is missing, a
directory, not UTF-8, or yields no tokens.

Not named `tokenize.py`: scripts in launch/ run with launch/ on sys.path, where such a file would
shadow the standard library's `tokenize` module (imported by torch through `inspect`).
"""

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere
from launch.precheck import ToolParser  # noqa: E402
from runtime.data import tokenizer_dir  # noqa: E402
from runtime.cli import os_error_message, report  # noqa: E402
from runtime.paths import check_not_input, check_output_file  # noqa: E402

CHUNK_CHARS = 1 << 22


def _chunks(path: str, chunk_chars: int = CHUNK_CHARS):
    """The text of `path` in pieces of about `chunk_chars` characters, each ending at a line break."""
    try:
        with open(path, encoding="utf-8") as f:
            lines, size = [], 0
            for line in f:
                lines.append(line)
                size += len(line)
                if size >= chunk_chars:
                    yield "".join(lines)
                    lines, size = [], 0
            if lines:
                yield "".join(lines)
    except UnicodeDecodeError as e:
        raise ValueError(f"input file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x}: {e.reason})") from None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """A tokenizer from a local tokenizer.json or tokenizer directory (runtime/data/tokenizer_dir.py)."""
    return tokenizer_dir.load_tokenizer(path, trust_remote_code)


def check_paths(paths: list[str], out: str, tokenizer_path: str) -> None:
    """ValueError if an input is missing or a directory, if `out` cannot be a file, or if `out`, its
    `.tmp` or its `.json` sidecar is an input or the tokenizer (writing would destroy it)."""
    for path in paths:
        if os.path.isdir(path):
            raise ValueError(f"input {path} is a directory, not a text file")
        if not os.path.isfile(path):
            raise ValueError(f"no such input file {path}")
    check_output_file("--out", out, "train.bin")
    outputs = {out: f"--out {out}", out + ".json": f"--out {out}'s sidecar {out}.json",
               out + ".tmp": f"--out {out}'s temporary file {out}.tmp"}
    inputs = [("an input file", p) for p in paths] + [("the --tokenizer file", tokenizer_path)]
    for written, name in outputs.items():
        check_not_input(name, written, inputs)


def tokenize_files(tokenizer_path: str, paths: list[str], out: str, eos: str | None = None,
                   trust_remote_code: bool = False, workers: int = 1) -> dict:
    """Write the token ids of `paths` to `out` and the sidecar `<out>.json`; returns the sidecar dict."""
    check_paths(paths, out, tokenizer_path)
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1")
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)  # ids are < vocab_size
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos is not None and eos_id is None:
        raise ValueError(f"--eos {eos!r} is not a token of {tokenizer_path}")
    try:
        num_tokens = _write_ids(tokenizer, paths, out + ".tmp", dtype, eos_id, workers)
        if num_tokens == 0:
            raise ValueError(f"the input files ({', '.join(paths)}) hold no tokens")
        os.replace(out + ".tmp", out)
    finally:
        if os.path.exists(out + ".tmp"):
            os.remove(out + ".tmp")
    meta = {"dtype": dtype.name, "vocab_size": vocab_size, "num_tokens": num_tokens}
    with open(out + ".json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def _write_ids(tokenizer, paths: list[str], tmp: str, dtype: np.dtype, eos_id: int | None, workers: int = 1) -> int:
    num_tokens = 0
    with open(tmp, "wb") as f, tokenizer_dir.ParallelEncoder(tokenizer, workers) as encoder:
        for path in paths:
            for chunk_ids in encoder.map(_chunks(path)):
                ids = np.asarray(chunk_ids, dtype=dtype)
                f.write(ids.tobytes())
                num_tokens += len(ids)
            if eos_id is not None:
                f.write(np.asarray([eos_id], dtype=dtype).tobytes())
                num_tokens += 1
    return num_tokens


def tokenize_indexed(tokenizer_path: str, paths: list[str], out: str, eos: str | None, unit: str,
                     trust_remote_code: bool = False, workers: int = 1) -> dict:
    """Write a Megatron indexed dataset `<prefix>.bin` + `.idx` (runtime/data/indexed.py; `out` = the prefix,
    `.bin` optional), one document per file, line or JSONL record (`unit`), plus the sidecar
    `<prefix>.bin.json`; uint16 ids when the vocabulary fits, else int32 (Megatron has no uint32)."""
    from runtime.data.indexed import IndexedWriter, text_documents

    prefix = out.removesuffix(".bin")
    check_paths(paths, prefix + ".bin", tokenizer_path)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos is not None and eos_id is None:
        raise ValueError(f"--eos {eos!r} is not a token of {tokenizer_path}")
    writer = IndexedWriter(prefix, np.uint16 if vocab_size <= 1 << 16 else np.int32)
    try:
        with tokenizer_dir.ParallelEncoder(tokenizer, workers) as encoder:
            for pieces in text_documents(paths, unit, _chunks):
                ids = [i for piece_ids in encoder.map(pieces) for i in piece_ids]
                writer.add_document(ids + ([eos_id] if eos_id is not None else []))
        if writer.num_tokens() == 0:
            raise ValueError(f"the input files ({', '.join(paths)}) hold no tokens")
        writer.finalize()
    finally:
        writer.abort()  # removes what finalize() did not rename
    meta = {"dtype": writer.dtype.name, "vocab_size": vocab_size, "num_tokens": writer.num_tokens(),
            "num_documents": len(writer.lengths)}
    with open(prefix + ".bin.json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(description="Tokenize text files into a flat .bin of token ids.", prefix="error")
    parser.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer.json or tokenizer directory")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let a tokenizer directory run its own code (Kimi's tokenization_kimi.py)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (same output for any N)")
    parser.add_argument("--out", required=True, help="output token file, e.g. data/train.bin")
    parser.add_argument("--eos", default=None, help="token appended after each file (e.g. '<|endoftext|>')")
    parser.add_argument("--format", choices=["flat", "indexed"], default="flat",
                        help="flat: one .bin of ids; indexed: a Megatron .bin + .idx with document boundaries")
    parser.add_argument("--document", choices=["file", "line", "jsonl"], default="file",
                        help="indexed: one document per input file, per non-empty line, or per JSONL record's \"text\"")
    parser.add_argument("files", nargs="+", help="UTF-8 text files, tokenized in this order")
    args = parser.parse_args(argv)
    if args.format == "flat" and args.document != "file":
        print(f"error: --document {args.document} applies to --format indexed only (a flat .bin records no documents)",
              file=sys.stderr)
        return 2
    try:
        if args.format == "indexed":
            meta = tokenize_indexed(args.tokenizer, args.files, args.out, args.eos, args.document,
                                    args.trust_remote_code, args.workers)
        else:
            meta = tokenize_files(args.tokenizer, args.files, args.out, args.eos, args.trust_remote_code, args.workers)
    except ValueError as e:
        return report(e)
    except OSError as e:  # a failed write (disk full) names no file: then it is the output
        return report(os_error_message(e, args.out))
    print(f"{args.out}: {meta['num_tokens']:,} tokens, {meta['dtype']}, vocab {meta['vocab_size']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
