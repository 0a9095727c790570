"""xgrammar structural tags over DeepSeek's DSML tool calls, for `tool_choice="required"` and a named function.

deepseek-recipe renders the prompt up to the opened calls block (`parsing_options.starts_in_tool_calls`), so the
output is one or more calls of the given tools (exactly one with `parallel_tool_calls=false`), then the block's
closing tag, as DeepSeek's chat format writes them (deepseek-recipe 0.2.0's rendering of an assistant's calls):

    <{M} invoke name="NAME">\n
    <{M} parameter name="P" string="true">raw text</{M} parameter>\n       a parameter whose schema is a plain string
    <{M} parameter name="Q" string="false">JSON value</{M} parameter>\n    any other (its value follows Q's schema)
    </{M} invoke>\n
    </{M} calls>

with M the `｜DSML｜` marker and V4.1's tag names; V4 writes `invoke`, `parameter` and `tool_calls` with no space
after the marker. recipe's stream parser finds the markup by the marker's token id, so the marker is matched as that
token (xgrammar's TokenFormat), never spelled from bytes, and raw text never holds the marker. A call holds the
tool's declared parameters in their declared order, the required ones always, so its arguments validate against the
tool's schema (JSON values by xgrammar's JSON-schema grammar; string values by their enum or const where given).
"""
from __future__ import annotations

MARKER = "｜DSML｜"
V4, V41 = "v4", "v41"
# (invoke, parameter, calls) tag names after the marker, by format
TAGS = {V4: ("invoke", "parameter", "tool_calls"), V41: (" invoke", " parameter", " calls")}


def tool_call_tag(tools: list[dict], fmt: str, marker_id: int, parallel: bool = True) -> dict:
    """The structural tag (xgrammar's JSON form, so_args schema_type "structural_tag") of DSML calls of `tools`
    (OpenAI `tools` entries) in format `fmt` (V4 / V41), the marker being token `marker_id`."""
    if fmt not in TAGS:
        raise ValueError(f"tool_call_tag: format {fmt!r} is not one of {sorted(TAGS)}")
    invoke, param, calls = TAGS[fmt]
    fns = [t.get("function", t) for t in tools]
    if not fns:
        raise ValueError("tools: a required tool call needs at least one tool")
    token = {"type": "token", "token": int(marker_id)}

    def text(s: str) -> dict:
        return {"type": "const_string", "value": s}

    def seq(*elements) -> dict:
        return {"type": "sequence", "elements": list(elements)}

    def close(name: str) -> list[dict]:
        return [text("</"), token, text(f"{name}>")]

    options = []
    for fn in fns:
        schema = fn.get("parameters") or {}
        props, required = schema.get("properties") or {}, set(schema.get("required") or ())
        body = [text("<"), token, text(f'{invoke} name="{fn["name"]}">\n')]
        for name, sub in props.items():
            raw = _raw_value(sub or {})
            value = raw or {"type": "json_schema", "json_schema": sub or {}, "style": "json"}
            one = seq(text("<"), token, text(f'{param} name="{name}" string="{"true" if raw else "false"}">'), value,
                      *close(param), text("\n"))
            body.append(one if name in required else {"type": "optional", "content": one})
        options.append(seq(*body, *close(invoke), text("\n")))
    call = options[0] if len(options) == 1 else {"type": "or", "elements": options}
    return {"type": "structural_tag",
            "format": seq({"type": "plus", "content": call} if parallel else call, *close(calls))}


def _raw_value(schema: dict) -> dict | None:
    """A string parameter's raw text (string="true", as recipe writes every string value): one of its `enum` or its
    `const` exactly, else any text without the marker (a `pattern`, `format` or length bound is not enforced);
    None for other schemas (a JSON value)."""
    if schema.get("type") != "string":
        return None
    if "const" in schema:
        return {"type": "const_string", "value": str(schema["const"])}
    if schema.get("enum"):
        return {"type": "or", "elements": [{"type": "const_string", "value": str(v)} for v in schema["enum"]]}
    return {"type": "any_text", "excludes": [MARKER]}
