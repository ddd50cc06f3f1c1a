"""``dlbricks results``: export the results store as CSV, JSON or Parquet."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dlbricks.commands._common import parse_g_list, require_store
from dlbricks.errors import UsageError
from dlbricks.store import EXPORT_FORMATS, KINDS, Store, StoreError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "results",
        help="export stored brick/model timings",
        description="Export the results store, one row per result: what it is (model name and path, brick op "
        "types, G, shapes), its statistics (median, percentiles, interval, drift, rounds, stop reason) and the "
        "runner settings that produced it. JSON adds systems and configs and is written result by result; "
        "raw iteration times only with --with-times. Parquet needs pyarrow.",
    )
    p.add_argument("--store", metavar="PATH", help="results store (default: the user cache store)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="csv", help="output format (default: csv)")
    p.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    p.add_argument("--kind", choices=KINDS, help="only brick or only model results")
    p.add_argument("--model", action="append", default=[], metavar="NAME|PATH",
                   help="only the results of this model (repeatable): an ONNX file or folder, whose bricks then "
                        "carry their occurrences (and shapes the store lacks), or the name of a model measured end to end")
    p.add_argument("-G", metavar="LIST",
                   help="granularities to decompose --model files at (default: every G the store has bricks of)")
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                   help="concrete shape for a graph input of the --model files (repeatable)")
    p.add_argument("--with-times", action="store_true", help="include every raw iteration time (JSON, Parquet)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; returns 0.

    Raises:
        UsageError: no store at --store, or a --model that names nothing.
        StoreError: the store is unreadable, or the format needs a missing package.
    """
    if args.G is not None:
        parse_g_list(args.G)  # checked even where no --model needs it: a typo is not ignored
    path = require_store(args.store)
    with Store(path, readonly=True) as store:
        only = described = None
        if args.model:
            only, described = _select_models(args, store)
        kw: dict[str, Any] = {"kind": args.kind, "with_times": args.with_times, "only": only, "described": described}
        if args.output and args.output != "-":
            n = store.export(args.format, args.output, **kw)
        elif args.format == "parquet":
            if sys.stdout.isatty():
                raise StoreError("refusing to write Parquet to a terminal; use -o FILE")
            n = store.export(args.format, sys.stdout.buffer, **kw)
        else:
            n = store.export(args.format, sys.stdout, **kw)
    print(f"dlbricks results: {n} result(s) from {store.path}", file=sys.stderr)
    return 0


def _select_models(args: argparse.Namespace, store: Store) -> tuple[set[tuple[str, str]], dict]:
    """The (kind, digest) pairs of the --model models' results, and what each is."""
    from dlbricks.analysis import load_corpus, print_err
    from dlbricks.commands._common import parse_input_shapes

    only: set[tuple[str, str]] = set()
    described: dict[tuple[str, str], dict[str, Any]] = {}
    files: list[str] = []
    by_name: dict[str, list[tuple[str, dict]]] = {}
    for (d, _v), m in store.models().items():
        if m.get("name"):
            by_name.setdefault(m["name"], []).append((d, m.get("meta") or {}))
    for item in args.model:
        if Path(item).exists():
            files.append(item)
            continue
        hits = by_name.get(item) or [hit for name, hs in by_name.items() if name.endswith("/" + item) for hit in hs]
        if not hits:
            known = ", ".join(sorted(by_name)[:8]) or "none"
            raise UsageError(f"--model {item}: no such file, and no model of that name in the store (models: {known})")
        for d, meta in hits:
            only.add(("model", d))
            recorded = meta.get("path")
            if recorded and Path(recorded).exists():
                files.append(recorded)
            else:
                print_err(f"--model {item}: its file ({recorded or 'not recorded'}) is not here: "
                          "only its end-to-end result and the bricks first seen in it are exported")
                for (bd, _bv), b in store.bricks().items():
                    if (b.get("meta") or {}).get("source_model") == item:
                        only.add(("brick", bd))
    if files:
        loaded = load_corpus(files, parse_input_shapes(args.input_shape), on_warning=print_err)
        for e in loaded.errors:
            print_err(f"skipped {e['error']}")
        Gs = parse_g_list(args.G) if args.G else sorted({int(b["g"]) for b in store.bricks().values() if b.get("g")})
        _describe_models(loaded.models, Gs or [1], only, described, store)
    return only, described


def _describe_models(models: list, Gs: list[int], only: set, described: dict, store: Store) -> None:
    """Every brick of ``models`` at each G and each whole model: selected, with the
    models it occurs in and its occurrences over them; a brick's shapes where the
    catalogue has none (reading them builds a fast-loaded model's layers)."""
    from dlbricks.bricks import model_digest
    from dlbricks.corpus import Corpus
    from dlbricks.model import layer_kinds
    from dlbricks.pipeline import brick_shapes
    from dlbricks.versions import brick_digest_version

    for m in models:
        d = model_digest(m)
        only.add(("model", d))
        described[("model", d)] = {"model": m.name, "model_path": m.path, "layers": m.n_layers}
    corpus = Corpus(models)
    kinds: dict[int, list[str]] = {}
    for G in Gs:
        sp = corpus.split(G)
        occ = sp.occurrences()
        digests = [bytes(sp.unique_digests[u]).hex() for u in range(sp.n_unique)]
        shaped = store.bricks_with_shapes(digests, brick_digest_version())
        for u, d in enumerate(digests):
            if ("brick", d) in described:
                continue
            m, members = sp.first_occurrence(u)
            if m not in kinds:
                kinds[m] = layer_kinds(models[m].layers)
            holders = [i for i in range(len(models)) if occ[i, u] > 0]
            only.add(("brick", d))
            described[("brick", d)] = {
                "model": ";".join(models[i].name for i in holders),
                "model_path": ";".join(str(models[i].path or "") for i in holders),
                "op_types": [kinds[m][int(i)] for i in members],
                "layers": len(members),
                "G": G,
                "shapes": None if d in shaped else brick_shapes(models[m], members),
                "occurrences": int(occ[:, u].sum()),
            }
