"""One chat message as the data has it -> one normalised message (data.jsonl's contract), what was mapped
or left out counted in `notes`.

Normalised: {"role": "system"|"user"|"assistant"|"tool", "content": str} and
  assistant: reasoning_content (read from reasoning_content, reasoning or thinking: vLLM's OpenAI server
             returns `reasoning`, some exports `thinking`), tool_calls ([{"id"?, "type": "function",
             "function": {"name", "arguments": dict}}]: HF chat templates expect the arguments as a mapping,
             OpenAI writes them as a JSON string), weight 0 (OpenAI fine-tuning: context, not supervised),
             token_ids and finish_reason (written by data.regenerate);
  tool:      tool_call_id, name.
A message may use role/content (OpenAI, SpecForge's `conversations`) or from/value (ShareGPT). A key the
normaliser does not use is counted as "unknown_key:<key>" (a null value loses nothing and is not counted:
parquet rows carry every column of every message).
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

from dflash_dist.data.skip import Skip, check_text

ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user",
         "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "model": "assistant", "tool": "tool", "function": "tool", "observation": "tool",
         "function_call": "assistant"}
# Each format's own names: a mapping from any other name is counted ("role:developer->system").
NATIVE_ROLES = {"system", "user", "assistant", "tool", "human", "gpt"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
_USED = {"assistant": {"tool_calls", "function_call", "token_ids", "finish_reason", "weight", *REASONING_KEYS},
         "tool": {"tool_call_id", "name", "weight"}, "user": {"weight"}, "system": {"weight"}}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return check_text(content, where)
    # OpenAI content parts: [{"type": "text", "text": ...}, ...]
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return check_text("".join(p["text"] for p in content), where)
    raise Skip("bad_format", f"{where}: content must be a string or a list of text parts")


def _arguments(args: Any, where: str) -> dict:
    """A call's arguments as a mapping (a JSON string decoded), or Skip("bad_format")."""
    if args is None:
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError) as exc:
            raise Skip("bad_format", f"{where}: arguments are a string but not JSON ({exc})") from exc
    if not isinstance(args, dict):
        raise Skip("bad_format", f"{where}: arguments must be a JSON object (or a string of one)")
    check_text(json.dumps(args, ensure_ascii=False), where)
    return args


def tool_calls(raw: Any, where: str) -> list[dict]:
    """OpenAI tool_calls ([{"id", "type", "function": {"name", "arguments"}}], or the flat
    [{"name", "arguments"}] some exports write) in the one form chat templates take."""
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        raise Skip("bad_format", f"{where}: tool_calls must be a list of calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where} tool call {j}"
        if not isinstance(call, dict):
            raise Skip("bad_format", f"{at}: expected an object")
        fn = call["function"] if isinstance(call.get("function"), dict) else call
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Skip("bad_format", f"{at}: the function's name must be a non-empty string")
        out = {"type": "function", "function": {"name": check_text(fn["name"], at),
                                                "arguments": _arguments(fn.get("arguments"), at)}}
        if isinstance(call.get("id"), str):
            out = {"id": call["id"], **out}
        calls.append(out)
    return calls


def _sharegpt_call(value: Any, where: str) -> list[dict]:
    """A ShareGPT function_call turn's value: JSON {"name", "arguments"} (or a list of them)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise Skip("bad_format", f"{where}: a function_call turn's value must be JSON "
                                     f"{{\"name\", \"arguments\"}} ({exc})") from exc
    return tool_calls(value, where)


def _reasoning(m: dict, where: str, notes: Counter) -> dict[str, str]:
    present = [k for k in REASONING_KEYS if m.get(k) is not None]
    if not present:
        return {}
    key = present[0]
    if not isinstance(m[key], str):
        raise Skip("bad_format", f"{where}: {key} must be a string")
    if key != "reasoning_content":
        notes[f"reasoning_field:{key}"] += 1
    for other in present[1:]:  # a second reasoning field is not read: counted, as any key left out
        notes[f"unknown_key:{other}"] += 1
    return {"reasoning_content": check_text(m[key], f"{where} {key}")}


def _assistant(m: dict, where: str, notes: Counter) -> dict[str, Any]:
    """The optional fields of an assistant message (module docstring), checked."""
    out = _reasoning(m, where, notes)
    if m.get("tool_calls"):  # null or [] (OpenAI exports write both for "no call"): none
        out["tool_calls"] = tool_calls(m["tool_calls"], where)
    elif isinstance(m.get("function_call"), dict):  # OpenAI's deprecated single call
        out["tool_calls"] = tool_calls([m["function_call"]], where)
        notes["function_call->tool_calls"] += 1
    if m.get("token_ids") is not None:
        ids = m["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise Skip("bad_format", f"{where}: token_ids must be a list of non-negative integers")
        out["token_ids"] = ids
    if m.get("finish_reason") is not None:
        if not isinstance(m["finish_reason"], str):
            raise Skip("bad_format", f"{where}: finish_reason must be a string")
        out["finish_reason"] = m["finish_reason"]
    return out


def _tool(m: dict, where: str) -> dict[str, str]:
    out = {}
    for key in ("tool_call_id", "name"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise Skip("bad_format", f"{where}: {key} must be a string")
            out[key] = check_text(m[key], f"{where} {key}")
    return out


def _weight(m: dict, role: str, where: str, notes: Counter) -> dict[str, int]:
    """OpenAI fine-tuning's per-message weight: 0 makes an assistant turn context; 1 is the default."""
    w = m.get("weight")
    if w is None:
        return {}
    if isinstance(w, bool) or w not in (0, 1):
        raise Skip("bad_format", f"{where}: weight must be 0 or 1 (OpenAI fine-tuning), not {w!r}")
    if role != "assistant":
        notes["weight_not_assistant"] += 1  # only an assistant turn is ever supervised
        return {}
    if w == 0:
        notes["weight0_turns"] += 1
        return {"weight": 0}
    return {}


def normalise(m: Any, i: int, notes: Counter) -> dict[str, Any]:
    """Message i of a conversation, normalised (module docstring), or Skip naming what is wrong."""
    where = f"message {i}"
    role_key, text_key = ("from", "value") if isinstance(m, dict) and "from" in m else ("role", "content")
    if not isinstance(m, dict) or role_key not in m:
        raise Skip("bad_format", f"{where}: expected an object with 'role' and 'content' (or 'from' and 'value')")
    name = m[role_key]
    if not isinstance(name, str):  # a list or object would not even hash as a key of ROLES
        raise Skip("bad_format", f"{where}: '{role_key}' must be a string, not {type(name).__name__}")
    if name not in ROLES:
        raise Skip("unknown_role", f"{where}: unknown role {name!r} (expected one of {sorted(ROLES)})")
    role = ROLES[name]
    if name not in NATIVE_ROLES:
        notes[f"role:{name}->{role}"] += 1
    extras = _assistant(m, where, notes) if role == "assistant" else _tool(m, where) if role == "tool" else {}
    content = m.get(text_key)
    if name == "function_call":  # ShareGPT: the value is the call itself
        extras["tool_calls"], content = _sharegpt_call(content, where), ""
    elif content is None and "tool_calls" in extras:  # OpenAI: content null beside the calls
        content = ""
    elif text_key not in m:
        raise Skip("bad_format", f"{where}: expected an object with '{role_key}' and '{text_key}'")
    msg: dict[str, Any] = {"role": role, "content": _text(content, where), **extras}
    msg.update(_weight(m, role, where, notes))
    used = {role_key, text_key} | _USED[role]
    notes.update(f"unknown_key:{k}" for k, v in m.items() if k not in used and v is not None)
    return msg


def decode_tools(raw: Any, notes: Counter) -> list[dict] | None:
    """A line's `tools`: a list of tool schemas, or a JSON string of one (ShareGPT exports), or None."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise Skip("bad_format", f"'tools' is a string but not JSON ({exc})") from exc
        notes["tools_json_string"] += 1
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise Skip("bad_format", "'tools' must be a list of tool objects (or a JSON string of one)")
    check_text(json.dumps(raw, ensure_ascii=False), "tools")
    return raw or None
