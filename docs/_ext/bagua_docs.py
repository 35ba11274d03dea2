"""The docs site's own Sphinx directives.

- ``runnable``: a Python example that the test suite runs on CPU (tests/docs). It renders as a Python code
  block; every one is listed, with its page and line, in ``runnable.json`` beside the built pages.

  ````markdown
  ```{runnable}
  :ranks: 2
  import bagua_lightning.torch_api as bagua
  ...
  ```
  ````

  ``:ranks: N`` runs the block as N processes under torchrun (Gloo); without it, as one plain process.

- ``proto-reference``: the gRPC API reference of a ``.proto`` file, from its comments (services and their
  rpcs, messages and their fields, enums), read from the descriptor that ``grpc_tools.protoc`` produces
  with source info.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import tempfile
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

RUNNABLE_FILE = "runnable.json"


# -- runnable examples ------------------------------------------------------------------------------------


class RunnableDirective(SphinxDirective):
    """A Python code block that the tests run (``:ranks: N``: under torchrun with N Gloo ranks)."""

    has_content = True
    optional_arguments = 1  # the language, accepted for symmetry with code-block; always python
    option_spec = {"ranks": directives.positive_int, "caption": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        code = "\n".join(self.content)
        if not code.strip():
            raise self.error("a runnable block has no code")
        if self.arguments and self.arguments[0] != "python":
            raise self.error(f"runnable blocks are Python, not {self.arguments[0]!r}: drop the language "
                             "or write ```{runnable} python")
        block = nodes.literal_block(code, code, language="python", classes=["runnable"])
        self.set_source_info(block)
        store: list[dict[str, Any]] = self.env.__dict__.setdefault("bagua_runnable", [])
        store.append({"docname": self.env.docname, "line": self.lineno, "ranks": self.options.get("ranks", 1),
                      "code": code + "\n"})
        caption = self.options.get("caption")
        if caption:
            container = nodes.container("", classes=["literal-block-wrapper"], literal_block=True)
            container += nodes.caption(caption, caption)
            container += block
            return [container]
        return [block]


def _purge_runnable(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    store = env.__dict__.get("bagua_runnable", [])
    env.__dict__["bagua_runnable"] = [entry for entry in store if entry["docname"] != docname]


def _merge_runnable(app: Sphinx, env: BuildEnvironment, docnames: set[str], other: BuildEnvironment) -> None:
    env.__dict__.setdefault("bagua_runnable", []).extend(other.__dict__.get("bagua_runnable", []))


def _write_runnable(app: Sphinx, exception: BaseException | None) -> None:
    if exception is not None:
        return
    store = sorted(app.env.__dict__.get("bagua_runnable", []), key=lambda e: (e["docname"], e["line"]))
    (Path(app.outdir) / RUNNABLE_FILE).write_text(json.dumps(store, indent=1))


# -- the gRPC reference from the proto's comments ----------------------------------------------------------

# Field numbers of descriptor.proto, for SourceCodeInfo paths.
_FILE_MESSAGE, _FILE_ENUM, _FILE_SERVICE = 4, 5, 6
_MESSAGE_FIELD, _MESSAGE_NESTED, _MESSAGE_ENUM = 2, 3, 4
_ENUM_VALUE, _SERVICE_METHOD = 2, 2
_FILE_SYNTAX = 12


def _descriptor(proto: Path) -> tuple[Any, dict[tuple[int, ...], Any]]:
    """The FileDescriptorProto of ``proto`` and its comments by path."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        well_known = str(importlib.resources.files("grpc_tools") / "_proto")
        rc = protoc.main(["protoc", f"-I{proto.parent}", f"-I{well_known}", "--include_source_info",
                          f"--descriptor_set_out={out}", proto.name])
        if rc != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit {rc})")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    fd = files.file[0]
    locations = {tuple(loc.path): loc for loc in fd.source_code_info.location}
    return fd, locations


def _escape(text: str) -> str:
    """Prose of a proto comment as reStructuredText: `quoted` words become inline literals, markup is escaped."""
    parts = re.split(r"`([^`]+)`", text)
    return "".join(f"``{part}``" if i % 2 else re.sub(r"([\\`*_|<>\[\]])", r"\\\1", part)
                   for i, part in enumerate(parts))


def _comment_rst(comment: str, indent: str = "") -> list[str]:
    """A proto comment as reStructuredText: prose paragraphs, and indented lines kept as a literal block."""
    lines: list[str] = []
    paragraphs = re.split(r"\n\s*\n", comment.strip("\n"))
    for paragraph in paragraphs:
        raw = [line[1:] if line.startswith(" ") else line for line in paragraph.split("\n")]
        prose: list[str] = []
        i = 0
        while i < len(raw):
            if raw[i].startswith(" "):  # an aligned table or list: keep its layout
                j = i
                while j < len(raw) and (raw[j].startswith(" ") or not raw[j].strip()):
                    j += 1
                if prose:
                    lines += [indent + _escape(" ".join(prose)), ""]
                    prose = []
                lines += [indent + ".. code-block:: text", ""] + [indent + "   " + r for r in raw[i:j]] + [""]
                i = j
            else:
                prose.append(raw[i].strip())
                i += 1
        if prose:
            lines += [indent + _escape(" ".join(prose)), ""]
    return lines


_SCALARS = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string", 12: "bytes",
            13: "uint32", 17: "sint32", 18: "sint64", 6: "fixed64", 7: "fixed32", 15: "sfixed32",
            16: "sfixed64"}


def _label(package: str, name: str) -> str:
    return f"proto-{package}.{name}".lower()


def _type_rst(field: Any, package: str) -> str:
    if field.type_name:  # ".bagua_lightning.autotune.v1.Hyperparameters"
        name = field.type_name.lstrip(".")
        short = name[len(package) + 1:] if name.startswith(package + ".") else name
        kind = f":ref:`{short} <{_label(package, short)}>`" if name.startswith(package + ".") else f"``{name}``"
    else:
        kind = f"``{_SCALARS.get(field.type, str(field.type))}``"
    return f"repeated {kind}" if field.label == 3 else kind


class ProtoReferenceDirective(SphinxDirective):
    """``.. proto-reference:: path/to/file.proto`` (relative to the repository root)."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        proto = (Path(self.env.srcdir).parent / self.arguments[0]).resolve()
        if not proto.is_file():
            raise self.error(f"proto-reference: {proto} does not exist; name a .proto file relative to the "
                             "repository root")
        self.env.note_dependency(str(proto))
        fd, comments = _descriptor(proto)
        text = self._rst(fd, comments)
        holder = nodes.section()
        holder.document = self.state.document
        nested_parse_with_titles(self.state, StringList(text, source=str(proto)), holder, self.content_offset)
        return list(holder.children)

    def _rst(self, fd: Any, comments: dict[tuple[int, ...], Any]) -> list[str]:
        package = fd.package

        def comment(path: tuple[int, ...], indent: str = "") -> list[str]:
            loc = comments.get(path)
            return _comment_rst(loc.leading_comments, indent) if loc and loc.leading_comments.strip() else []

        out: list[str] = []
        header = comments.get((_FILE_SYNTAX,))
        if header is not None:
            for detached in header.leading_detached_comments:
                out += _comment_rst(detached)
        out += [f"Package ``{package}`` (file ``{Path(fd.name).name}``).", ""]
        for s_index, service in enumerate(fd.service):
            title = f"Service {service.name}"
            out += [f".. _{_label(package, service.name)}:", "", title, "-" * len(title), ""]
            out += comment((_FILE_SERVICE, s_index))
            for m_index, method in enumerate(service.method):
                request = method.input_type.lstrip(".").removeprefix(package + ".")
                response = method.output_type.lstrip(".").removeprefix(package + ".")
                mtitle = f"{service.name}.{method.name}"
                out += [mtitle, "~" * len(mtitle), ""]
                out += [f"``rpc {method.name}({request}) returns ({response})``: request "
                        f":ref:`{request} <{_label(package, request)}>`, response "
                        f":ref:`{response} <{_label(package, response)}>`.", ""]
                out += comment((_FILE_SERVICE, s_index, _SERVICE_METHOD, m_index))
        out += ["Messages", "--------", ""]
        for index, message in enumerate(fd.message_type):
            out += self._message(message, (_FILE_MESSAGE, index), package, comment)
        if fd.enum_type:
            out += ["Enums", "-----", ""]
            for index, enum in enumerate(fd.enum_type):
                out += self._enum(enum, (_FILE_ENUM, index), package, comment)
        return out

    def _message(self, message: Any, path: tuple[int, ...], package: str, comment: Any,
                 prefix: str = "") -> list[str]:
        name = prefix + message.name
        out = [f".. _{_label(package, name)}:", "", name, "~" * len(name), ""]
        out += comment(path)
        if message.field:
            out += [".. list-table::", "   :header-rows: 1", "   :widths: 20 8 22 50", "",
                    "   * - field", "     - number", "     - type", "     - meaning"]
            for f_index, field in enumerate(message.field):
                meaning = comment((*path, _MESSAGE_FIELD, f_index), "       ") or ["       \\"]
                out += [f"   * - ``{field.name}``", f"     - {field.number}", f"     - {_type_rst(field, package)}",
                        "     -", "", *meaning]
            out.append("")
        else:
            out += ["No fields.", ""]
        if message.reserved_range:
            numbers = ", ".join(str(r.start) if r.end - r.start == 1 else f"{r.start}-{r.end - 1}"
                                for r in message.reserved_range)
            out += [f"Reserved field numbers: {numbers}.", ""]
        for n_index, nested in enumerate(message.nested_type):
            out += self._message(nested, (*path, _MESSAGE_NESTED, n_index), package, comment, prefix=name + ".")
        for e_index, enum in enumerate(message.enum_type):
            out += self._enum(enum, (*path, _MESSAGE_ENUM, e_index), package, comment, prefix=name + ".")
        return out

    def _enum(self, enum: Any, path: tuple[int, ...], package: str, comment: Any, prefix: str = "") -> list[str]:
        name = prefix + enum.name
        out = [f".. _{_label(package, name)}:", "", name, "~" * len(name), ""]
        out += comment(path)
        out += [".. list-table::", "   :header-rows: 1", "   :widths: 30 10 60", "",
                "   * - value", "     - number", "     - meaning"]
        for v_index, value in enumerate(enum.value):
            meaning = comment((*path, _ENUM_VALUE, v_index), "       ") or ["       \\"]
            out += [f"   * - ``{value.name}``", f"     - {value.number}", "     -", "", *meaning]
        out.append("")
        return out


def _canonical_aliases_are_no_duplicates() -> None:
    """Two pages that document one class under two public names (``torch_api.ReduceOp`` and
    ``torch_api.communication.ReduceOp``) both record its defining module's name as an alias
    (``:canonical:``); Sphinx calls the second alias a duplicate. It is the same object: keep the first."""
    from sphinx.domains.python import PythonDomain

    note_object = PythonDomain.note_object
    if getattr(note_object, "_bagua_docs", False):
        return

    def note(self: PythonDomain, name: str, objtype: str, node_id: str, aliased: bool = False,
             location: Any = None) -> None:
        if aliased and name in self.objects and self.objects[name].aliased:
            return
        note_object(self, name, objtype, node_id, aliased, location)

    note._bagua_docs = True  # type: ignore[attr-defined]
    PythonDomain.note_object = note  # type: ignore[method-assign]


# -- benchmark plots -----------------------------------------------------------------------------------------


class BenchmarkPlotsDirective(SphinxDirective):
    """``benchmark-plots``: every plot of ``docs/benchmarks/results/manifest.json`` (drawn by
    ``python -m benchmarks.plots`` into ``docs/_static/benchmarks/``), each under its title, command, machine
    and date. A plot that was not drawn is a missing image: a build error."""

    def run(self) -> list[nodes.Node]:
        manifest = Path(self.env.srcdir) / "benchmarks" / "results" / "manifest.json"
        self.env.note_dependency(str(manifest))
        out: list[nodes.Node] = []
        for entry in json.loads(manifest.read_text()):
            stem = Path(entry["file"]).stem
            self.env.note_dependency(str(Path(self.env.srcdir) / "_static" / "benchmarks" / f"{stem}.png"))
            figure = nodes.figure(ids=[nodes.make_id(f"plot-{stem}")])
            figure += nodes.image(uri=f"/_static/benchmarks/{stem}.png", alt=entry["title"])
            caption = nodes.caption()
            caption += nodes.strong(text=entry["title"])
            caption += nodes.Text(". ")
            caption += nodes.literal(text=entry["command"])
            caption += nodes.Text(f"; {entry['machine']}, {entry['date']}; results: ")
            caption += nodes.literal(text=f"docs/benchmarks/results/{entry['file']}")
            figure += caption
            out.append(figure)
        return out


def _drop_missing_optional_docs(app: Sphinx, docname: str, source: list[str]) -> None:
    """A toctree line naming an optional page that does not exist (``bagua_optional_docs``) is removed."""
    missing = [name for name in app.config.bagua_optional_docs if name not in app.env.found_docs]
    if missing:
        source[0] = "\n".join(line for line in source[0].split("\n") if line.strip() not in missing)


def setup(app: Sphinx) -> dict[str, Any]:
    _canonical_aliases_are_no_duplicates()
    app.add_config_value("bagua_optional_docs", [], "env")
    app.connect("source-read", _drop_missing_optional_docs)
    app.add_directive("runnable", RunnableDirective)
    app.add_directive("proto-reference", ProtoReferenceDirective)
    app.add_directive("benchmark-plots", BenchmarkPlotsDirective)
    app.connect("env-purge-doc", _purge_runnable)
    app.connect("env-merge-info", _merge_runnable)
    app.connect("build-finished", _write_runnable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
