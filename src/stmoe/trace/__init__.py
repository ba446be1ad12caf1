"""Routing traces: the data model, its file format, importers and generators."""

from stmoe.trace.importers import FORMATS, import_file, import_files, load_trace, sniff_format
from stmoe.trace.io import FORMAT_VERSION, read_native, save_trace
from stmoe.trace.schema import EMPTY_SLOT, UNLABELLED, RoutingTrace, TraceMeta, validate
from stmoe.trace.select import (
    concat,
    decode_only,
    select_domain,
    select_sequences,
    split,
    split_auto,
)
from stmoe.trace.summary import expert_load, summarize
from stmoe.trace.synth import SynthSpec, synthesize

__all__ = [
    "EMPTY_SLOT",
    "FORMATS",
    "FORMAT_VERSION",
    "UNLABELLED",
    "RoutingTrace",
    "SynthSpec",
    "TraceMeta",
    "concat",
    "decode_only",
    "expert_load",
    "import_file",
    "import_files",
    "load_trace",
    "read_native",
    "save_trace",
    "select_domain",
    "select_sequences",
    "sniff_format",
    "split",
    "split_auto",
    "summarize",
    "synthesize",
    "validate",
]
