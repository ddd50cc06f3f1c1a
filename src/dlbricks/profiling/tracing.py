"""Spans for ``dlbricks profile``: a Chrome trace and, optionally, OpenTelemetry.

A :class:`Recorder` records every span twice from one call: as a Chrome
trace-event "complete" event (``ph: "X"``, microseconds), which Perfetto and
``chrome://tracing`` open, and, when OpenTelemetry is configured, as an
OpenTelemetry span exported to a JSON-lines file or to an OTLP/HTTP endpoint.
Spans name their parent explicitly (never through an implicit "current span"),
and can be recorded after the fact with measured start and end times: the layer
spans come out of onnxruntime's profile once the run is over.

Distributed tracing, as in XSP: a worker process gets the W3C ``traceparent`` of
its parent span (:meth:`Recorder.carrier`) and the exporter settings
(:class:`OtelConfig`), builds its own :class:`Recorder` with
:meth:`Recorder.child`, and exports its spans itself; they carry the parent's
trace id, so one trace covers every process. Its Chrome events travel back to the
parent with the results (:meth:`Recorder.events` / :meth:`Recorder.merge`).

All times are Unix-epoch nanoseconds (:func:`now_ns`), which every process on the
machine shares.

OpenTelemetry is imported lazily, and only when asked for.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import numbers
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from dlbricks.errors import DlbricksError, UsageError

__all__ = [
    "ChromeEvent",
    "OtelConfig",
    "Recorder",
    "SpanRef",
    "now_ns",
    "perf_to_epoch_ns",
    "to_jsonable",
    "validate_chrome_trace",
]

#: Chrome trace phases this module writes or accepts on validation.
_PHASES = {"X", "B", "E", "i", "I", "M", "C", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"}

# perf_counter (CLOCK_MONOTONIC) -> Unix epoch, measured once per process: the
# spans need one clock that every process shares, and perf_counter is what the
# timing loops read.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()


def now_ns() -> int:
    """Now, as Unix-epoch nanoseconds on this process's steady clock."""
    return time.perf_counter_ns() + _EPOCH_OFFSET_NS


def perf_to_epoch_ns(perf_ns: int) -> int:
    """Convert a ``time.perf_counter_ns()`` reading to Unix-epoch nanoseconds."""
    return int(perf_ns) + _EPOCH_OFFSET_NS


# --------------------------------------------------------------------------- OpenTelemetry


@dataclass(frozen=True)
class OtelConfig:
    """Where OpenTelemetry spans go; picklable, so worker processes get a copy.

    Attributes:
        file: append spans as JSON lines to this file.
        endpoint: export with OTLP/HTTP (protobuf) to this URL; a URL without a
            path gets ``/v1/traces``.
        service_name: the ``service.name`` resource attribute.
    """

    file: str | None = None
    endpoint: str | None = None
    service_name: str = "dlbricks"

    @property
    def enabled(self) -> bool:
        return bool(self.file or self.endpoint)

    def traces_url(self) -> str | None:
        """The full OTLP traces URL.

        Raises:
            UsageError: the endpoint is not an http(s) URL.
        """
        if not self.endpoint:
            return None
        parts = urllib.parse.urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"--otlp-endpoint {self.endpoint!r}: expected an http(s) URL such as http://localhost:4318")
        if parts.path in ("", "/"):
            parts = parts._replace(path="/v1/traces")
        return urllib.parse.urlunsplit(parts)


def _require_otel() -> None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise DlbricksError(
            "OpenTelemetry output needs the OpenTelemetry SDK; install it with "
            "`pip install dlbricks[trace]` (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
        ) from None


def _json_lines_exporter_class() -> type:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLinesSpanExporter(SpanExporter):
        """Writes each finished span as one JSON line, appending with one ``write(2)``
        per span so that several processes can share the file."""

        def __init__(self, path: str):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._lock = threading.Lock()

        def export(self, spans: Sequence[Any]) -> Any:
            with self._lock:
                if self._fd is None:
                    return SpanExportResult.FAILURE
                for span in spans:
                    line = json.dumps(_span_to_dict(span), separators=(",", ":"), default=str) + "\n"
                    os.write(self._fd, line.encode())
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            with self._lock:
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return JsonLinesSpanExporter


def _span_to_dict(span: Any) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "kind": span.kind.name,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "resource": dict(span.resource.attributes) if span.resource is not None else {},
    }


class _Otel:
    """A TracerProvider with the configured exporter (not installed globally)."""

    def __init__(self, config: OtelConfig):
        _require_otel()
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        from dlbricks import __version__

        resource = Resource.create(
            {"service.name": config.service_name, "service.version": __version__, "process.pid": os.getpid()}
        )
        url = config.traces_url()
        otlp_exporter = None
        if url:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise DlbricksError(
                    "--otlp-endpoint needs the OTLP/HTTP exporter; install it with "
                    "`pip install dlbricks[trace]` (opentelemetry-exporter-otlp-proto-http)"
                ) from None
            otlp_exporter = _counting(OTLPSpanExporter(endpoint=url, timeout=10))
            # Its retries log a paragraph each; what reached the collector is told once,
            # at the end (:attr:`export_error`).
            logging.getLogger(OTLPSpanExporter.__module__).setLevel(logging.CRITICAL)
        self.url = url
        self._otlp = otlp_exporter
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if config.file:
            self.provider.add_span_processor(SimpleSpanProcessor(_json_lines_exporter_class()(config.file)))
        if otlp_exporter is not None:
            # A profile records thousands of layer spans at once: the default queue
            # (2048) would drop most of them.
            self.provider.add_span_processor(
                BatchSpanProcessor(otlp_exporter, max_queue_size=1 << 17, max_export_batch_size=1024)
            )
        self.tracer = self.provider.get_tracer("dlbricks.profile")

    def start(self, name: str, parent: Any, start_ns: int, attributes: Mapping[str, Any]) -> Any:
        from opentelemetry import trace

        if parent is None:
            ctx = None
        elif isinstance(parent, SpanRef):
            ctx = trace.set_span_in_context(parent.otel) if parent.otel is not None else parent.otel_context
        else:
            ctx = parent
        return self.tracer.start_span(name, context=ctx, start_time=int(start_ns), attributes=_otel_attributes(attributes))

    def shutdown(self) -> str | None:
        """Flush and close; what went wrong exporting to the endpoint (None: nothing)."""
        self.provider.shutdown()
        failed = getattr(self._otlp, "failed_spans", 0)
        if failed:
            return (f"--otlp-endpoint {self.url}: {failed} span(s) were not exported (the collector did not "
                    "accept them; is it running there?)")
        return None


def _counting(exporter: Any) -> Any:
    """``exporter`` with a count of the spans its exports failed to deliver (``failed_spans``)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Counting(SpanExporter):
        def __init__(self) -> None:
            self.failed_spans = 0

        def export(self, spans: Sequence[Any]) -> Any:
            result = exporter.export(spans)
            if result != SpanExportResult.SUCCESS:
                self.failed_spans += len(spans)
            return result

        def shutdown(self) -> None:
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(exporter.force_flush(timeout_millis))

    return Counting()


def _otel_attributes(args: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten ``args`` into OpenTelemetry attribute values (primitives or
    homogeneous lists of primitives); nested dicts become dotted keys."""
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = f"{prefix}{key}"
        if value is None:
            continue
        if isinstance(value, Mapping):
            out.update(_otel_attributes(value, name + "."))
        elif isinstance(value, (bool, str)):
            out[name] = value
        elif isinstance(value, numbers.Integral):
            out[name] = int(value)
        elif isinstance(value, numbers.Real):
            if math.isfinite(float(value)):
                out[name] = float(value)
        elif isinstance(value, (list, tuple)):
            if all(isinstance(v, str) for v in value):
                out[name] = list(value)
            elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                out[name] = [float(v) for v in value] if any(isinstance(v, float) for v in value) else list(value)
            else:
                out[name] = json.dumps(value, default=str)
        else:
            out[name] = str(value)
    return out


# --------------------------------------------------------------------------- recorder


@dataclass
class ChromeEvent:
    """One complete span, before conversion to the trace-event format."""

    name: str
    start_ns: int
    end_ns: int
    pid: int
    track: str
    cat: str
    args: dict[str, Any]
    span_id: str
    parent_id: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "pid": self.pid,
            "track": self.track,
            "cat": self.cat,
            "args": self.args,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChromeEvent:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass
class SpanRef:
    """A span being recorded: its id for children, and its OpenTelemetry span."""

    id: str
    name: str
    start_ns: int
    parent: SpanRef | None = None
    args: dict[str, Any] = field(default_factory=dict)
    cat: str = "dlbricks"
    track: str = "main"
    end_ns: int | None = None
    otel: Any = None
    otel_context: Any = None  # a remote parent extracted from a carrier


class Recorder:
    """Records spans as Chrome trace events and (optionally) OpenTelemetry spans.

    Args:
        otel: where OpenTelemetry spans go (None or an empty config: nowhere).
        process_name: the name shown for this process's track.

    Raises:
        DlbricksError: OpenTelemetry output was asked for but is not installed.
        UsageError: a malformed OTLP endpoint.
    """

    def __init__(self, otel: OtelConfig | None = None, *, process_name: str = "dlbricks"):
        self.otel_config = otel if otel is not None and otel.enabled else None
        self._otel = _Otel(self.otel_config) if self.otel_config is not None else None
        self.pid = os.getpid()
        self.process_name = process_name
        self._events: list[ChromeEvent] = []
        self._ids = itertools.count(1)
        self._remote_parent: SpanRef | None = None
        self.processes: dict[int, str] = {self.pid: process_name}
        #: Set by :meth:`shutdown` when spans did not reach the OTLP endpoint.
        self.export_error: str | None = None

    @classmethod
    def child(
        cls, otel: OtelConfig | None, carrier: Mapping[str, str] | None, parent_id: str | None, *, process_name: str
    ) -> tuple[Recorder, SpanRef | None]:
        """A recorder for a worker process, and the remote parent to hang its spans on.

        Args:
            otel: the parent's configuration (``Recorder.otel_config``).
            carrier: the parent's :meth:`carrier` (W3C ``traceparent``).
            parent_id: the Chrome span id of the parent span.
            process_name: this process's track name.
        """
        rec = cls(otel, process_name=process_name)
        if parent_id is None:
            return rec, None
        ctx = None
        if rec._otel is not None and carrier:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            ctx = TraceContextTextMapPropagator().extract(carrier=dict(carrier))
        parent = SpanRef(id=parent_id, name="(remote parent)", start_ns=0, otel_context=ctx)
        rec._remote_parent = parent
        return rec, parent

    @property
    def otel_enabled(self) -> bool:
        return self._otel is not None

    def _new_id(self) -> str:
        return f"{self.pid}.{next(self._ids)}"

    def start(
        self,
        name: str,
        *,
        parent: SpanRef | None = None,
        start_ns: int | None = None,
        args: Mapping[str, Any] | None = None,
        cat: str = "dlbricks",
    ) -> SpanRef:
        """Open a span (end it with :meth:`end`)."""
        t0 = now_ns() if start_ns is None else int(start_ns)
        ref = SpanRef(id=self._new_id(), name=name, start_ns=t0, parent=parent, args=dict(args or {}), cat=cat)
        if self._otel is not None:
            ref.otel = self._otel.start(name, parent, t0, ref.args)
        return ref

    def end(self, ref: SpanRef, *, end_ns: int | None = None, args: Mapping[str, Any] | None = None) -> SpanRef:
        """Close a span opened with :meth:`start`, adding ``args``."""
        t1 = now_ns() if end_ns is None else int(end_ns)
        ref.end_ns = max(t1, ref.start_ns)
        ref.args.update(args or {})
        if ref.otel is not None:
            if args:
                ref.otel.set_attributes(_otel_attributes(args))
            ref.otel.end(end_time=ref.end_ns)
        self._events.append(
            ChromeEvent(
                name=ref.name,
                start_ns=ref.start_ns,
                end_ns=ref.end_ns,
                pid=self.pid,
                track=ref.track,
                cat=ref.cat,
                args=ref.args,
                span_id=ref.id,
                parent_id=ref.parent.id if ref.parent is not None else None,
            )
        )
        return ref

    def add(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        *,
        parent: SpanRef | None = None,
        args: Mapping[str, Any] | None = None,
        cat: str = "dlbricks",
    ) -> SpanRef:
        """Record a finished span with measured times (e.g. one from onnxruntime's profile)."""
        ref = self.start(name, parent=parent, start_ns=start_ns, args=args, cat=cat)
        return self.end(ref, end_ns=end_ns)

    def carrier(self, ref: SpanRef) -> dict[str, str]:
        """The W3C trace context of ``ref`` (``traceparent``), for a worker process;
        empty without OpenTelemetry."""
        if ref.otel is None:
            return {}
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(ref.otel))
        return carrier

    def events(self) -> list[dict[str, Any]]:
        """The recorded spans as picklable dicts (to send to the parent process)."""
        return [e.to_dict() for e in self._events]

    def merge(self, events: Iterable[Mapping[str, Any]], process_name: str | None = None) -> None:
        """Add spans recorded by another process (see :meth:`events`)."""
        for d in events:
            ev = ChromeEvent.from_dict(d)
            self._events.append(ev)
            if process_name is not None:
                self.processes.setdefault(ev.pid, process_name)

    def shutdown(self) -> None:
        """Flush and close the OpenTelemetry exporters (idempotent); a failed export to
        the OTLP endpoint is kept in :attr:`export_error`."""
        if self._otel is not None:
            self.export_error = self._otel.shutdown()
            self._otel = None

    def chrome_trace(self, *, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The Chrome trace-event JSON object (JSON Object Format).

        ``ts``/``dur`` are microseconds from the earliest span; ``otherData.origin_unix_ns``
        gives that origin. Each span's ``args`` carry ``span_id`` and ``parent_id``
        so that nesting can be checked without relying on time containment alone.
        """
        origin = min((e.start_ns for e in self._events), default=now_ns())
        tracks: dict[tuple[int, str], int] = {}
        out: list[dict[str, Any]] = []
        for pid, pname in sorted(self.processes.items()):
            out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": pname}})
        for ev in sorted(self._events, key=lambda e: (e.pid, e.start_ns, -(e.end_ns - e.start_ns))):
            key = (ev.pid, ev.track)
            if key not in tracks:
                tracks[key] = len([k for k in tracks if k[0] == ev.pid]) + 1
                out.append({"name": "thread_name", "ph": "M", "pid": ev.pid, "tid": tracks[key], "args": {"name": ev.track}})
                if ev.pid not in self.processes:
                    out.append({"name": "process_name", "ph": "M", "pid": ev.pid, "tid": 0, "args": {"name": f"pid {ev.pid}"}})
                    self.processes[ev.pid] = f"pid {ev.pid}"
            args = to_jsonable(dict(ev.args))
            args["span_id"] = ev.span_id
            args["parent_id"] = ev.parent_id
            out.append(
                {
                    "name": ev.name,
                    "cat": ev.cat,
                    "ph": "X",
                    "ts": (ev.start_ns - origin) / 1000.0,
                    "dur": (ev.end_ns - ev.start_ns) / 1000.0,
                    "pid": ev.pid,
                    "tid": tracks[key],
                    "args": args,
                }
            )
        other = {"origin_unix_ns": origin, "producer": "dlbricks profile"}
        other.update(metadata or {})
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": to_jsonable(other)}


def to_jsonable(obj: Any) -> Any:
    """Replace what JSON cannot hold (NaN, inf, numpy scalars, tuples) recursively."""
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    try:
        import numpy as np

        if isinstance(obj, np.integer):
            return int(obj)
        if isinstance(obj, np.floating):
            return to_jsonable(float(obj))
    except ImportError:  # pragma: no cover
        pass
    return str(obj)


# --------------------------------------------------------------------------- validation


def validate_chrome_trace(trace: Any, *, slack_us: float = 0.001) -> list[str]:
    """Check a trace against the trace-event format and dlbricks' nesting rules.

    Format (the Trace Event Format document): a JSON object with a
    ``traceEvents`` list, or a bare list; every event an object with a string
    ``name`` and a known ``ph``; ``pid``/``tid`` integers; ``ts`` a number for
    every phase but metadata; complete events (``X``) a non-negative ``dur``;
    metadata events (``M``) of the ``*_name``/``*_sort_index`` kinds an ``args``
    object with the value. Nesting: on each (pid, tid) track complete events nest
    properly (no partial overlap), and an event whose ``args.parent_id`` names
    another event lies within it (across processes too), to ``slack_us``.

    Args:
        trace: the parsed JSON.
        slack_us: tolerated overhang, in microseconds (the default absorbs the
            rounding of ``ts + dur`` in floating point).

    Returns:
        Problems, one line each; empty when the trace is valid.
    """
    problems: list[str] = []
    if isinstance(trace, Mapping):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ["traceEvents is missing or not a list"]
        unit = trace.get("displayTimeUnit")
        if unit is not None and unit not in ("ms", "ns"):
            problems.append(f"displayTimeUnit must be 'ms' or 'ns', got {unit!r}")
    elif isinstance(trace, list):
        events = trace
    else:
        return [f"a trace is a JSON object or list, got {type(trace).__name__}"]

    complete: list[tuple[int, dict[str, Any]]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for i, ev in enumerate(events):
        where = f"event {i}"
        if not isinstance(ev, Mapping):
            problems.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        if ph not in _PHASES:
            problems.append(f"{where}: unknown phase {ph!r}")
            continue
        if not isinstance(ev.get("name"), str):
            problems.append(f"{where}: name must be a string")
        for key in ("pid", "tid"):
            if key in ev and not (isinstance(ev[key], int) and not isinstance(ev[key], bool)):
                problems.append(f"{where}: {key} must be an integer, got {ev[key]!r}")
        if ph != "M":
            ts = ev.get("ts")
            if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
                problems.append(f"{where} ({ev.get('name')!r}): ts must be a finite number, got {ts!r}")
                continue
        if "args" in ev and not isinstance(ev["args"], Mapping):
            problems.append(f"{where}: args must be an object")
            continue
        if ph == "M":
            if str(ev.get("name", "")).endswith("_name") and not isinstance((ev.get("args") or {}).get("name"), str):
                problems.append(f"{where}: metadata {ev.get('name')!r} needs args.name")
            continue
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or isinstance(dur, bool) or not math.isfinite(dur) or dur < 0:
                problems.append(f"{where} ({ev.get('name')!r}): complete events need dur >= 0, got {dur!r}")
                continue
            if "pid" not in ev or "tid" not in ev:
                problems.append(f"{where} ({ev.get('name')!r}): complete events need pid and tid")
                continue
            complete.append((i, dict(ev)))
            sid = (ev.get("args") or {}).get("span_id")
            if sid is not None:
                if sid in by_id:
                    problems.append(f"{where}: duplicate span_id {sid!r}")
                by_id[str(sid)] = dict(ev)

    # Proper nesting per track: a stack of open intervals.
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for _, ev in complete:
        tracks.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for (pid, tid), evs in tracks.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for ev in evs:
            start, end = ev["ts"], ev["ts"] + ev["dur"]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= start + slack_us:
                stack.pop()
            if stack and end > stack[-1]["ts"] + stack[-1]["dur"] + slack_us:
                top = stack[-1]
                problems.append(
                    f"pid {pid} tid {tid}: {ev['name']!r} [{start:.3f}, {end:.3f}] overlaps "
                    f"{top['name']!r} [{top['ts']:.3f}, {top['ts'] + top['dur']:.3f}] without nesting"
                )
                continue
            stack.append(ev)

    for _, ev in complete:
        pid_ = (ev.get("args") or {}).get("parent_id")
        if pid_ is None:
            continue
        parent = by_id.get(str(pid_))
        if parent is None:
            problems.append(f"{ev['name']!r}: parent_id {pid_!r} names no span")
            continue
        if ev["ts"] + slack_us < parent["ts"] or ev["ts"] + ev["dur"] > parent["ts"] + parent["dur"] + slack_us:
            problems.append(
                f"{ev['name']!r} [{ev['ts']:.3f}, {ev['ts'] + ev['dur']:.3f}] is not within its parent "
                f"{parent['name']!r} [{parent['ts']:.3f}, {parent['ts'] + parent['dur']:.3f}]"
            )
    return problems
