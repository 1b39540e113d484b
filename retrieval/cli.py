"""``vllm-treespec datastore``: build and inspect corpus datastores.

    vllm-treespec datastore build --tokenizer <model or path> FILE [FILE ...] -o PATH [--max-tokens N]
    vllm-treespec datastore info PATH [--verify]

``main(argv)`` takes the arguments after ``datastore``.
"""

from __future__ import annotations

import argparse
import sys
import time

import msgspec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-treespec datastore", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="tokenise corpus files and write a suffix-automaton datastore")
    build.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer name or local path")
    build.add_argument("files", nargs="+", help="corpus files: plain text, .jsonl, or .json (ShareGPT-style arrays); "
                       "lists of token ids under 'output_ids' or 'token_ids' are indexed as they are")
    build.add_argument("-o", "--output", required=True, help="datastore file to write")
    build.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    build.add_argument("--batch-size", type=int, default=64, help="documents per tokenizer call")
    build.add_argument("--no-progress", action="store_true", help="no progress bar")
    info = sub.add_parser("info", help="print a datastore's header")
    info.add_argument("path")
    info.add_argument("--verify", action="store_true", help="also verify the array checksums")
    return parser


def main(argv: list[str] | None = None) -> int:
    from .datastore import DatastoreError, build_datastore, load_datastore

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "build":
            start = time.perf_counter()
            header = build_datastore(args.tokenizer, args.files, args.output, max_tokens=args.max_tokens,
                                     batch_size=args.batch_size, progress=not args.no_progress)
            ds = load_datastore(args.output)
            print(f"wrote {args.output}: {header.num_documents} documents, {header.num_tokens} tokens, "
                  f"{header.num_states} states, {header.num_edges} edges, {ds.automaton.nbytes / 2**20:.1f} MiB "
                  f"in {time.perf_counter() - start:.1f} s")
        else:
            ds = load_datastore(args.path, verify_checksums=args.verify)
            header = msgspec.to_builtins(ds.header)
            header.pop("arrays")
            print(msgspec.json.format(msgspec.json.encode(header)).decode())
            if args.verify:
                print("checksums ok")
    except (DatastoreError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
