#!/usr/bin/env python3
"""Writes the expected renderings of the real chat templates, for tests/unit/test_template.c.

    python3 tools/template_goldens.py [--templates DIR] [--out DIR]

Each template in DIR (default ../shared/data/templates) is rendered with Python jinja2 the way
transformers' apply_chat_template renders it: an ImmutableSandboxedEnvironment with
trim_blocks and lstrip_blocks, the loopcontrols extension, transformers' tojson filter and its
raise_exception / strftime_now globals, and the keyword arguments messages, tools, documents,
add_generation_prompt, the special tokens and any extra ones. Every conversation fit for the
template's family is rendered; the output, or the message of the exception the template
raises, goes to OUT/<template name>.json (default tests/fixtures/templates) together with the
context, so that the C renderer can be checked byte for byte. strftime_now sees NOW.

harmony.json lists the openai/harmony test vectors (DIR/harmony/*.txt) that the gpt-oss
template reproduces, with the context that reproduces each; the C test compares against those
files directly, the way upstream does (\\r\\n as \\n, trailing whitespace stripped).
"""
import argparse
import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOW = datetime.datetime(2025, 6, 28, 12, 0, 0)


def environment(undefined=jinja2.Undefined):
    """transformers' chat-template environment (chat_template_utils._compile_jinja_template)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return NOW.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=undefined,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


# --- conversations ----------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "What is the capital of France?"}
ANSWER = {"role": "assistant", "content": "The capital of France is Paris."}
USER2 = {"role": "user", "content": "And of Germany?"}
# Whitespace at both ends (trim), quotes, backslashes, a tab, newlines, non-ASCII and an emoji.
TRICKY = {"role": "user", "content": "  Привет 👋 «quoted» \"double\" 'single' \\ back\tslash\n"
                                     "second line: 5 < 6 & 7 > 3  \n"}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city, e.g. Zürich.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
                "days": {"type": "integer", "description": "Forecast days"},
                "hourly": {"type": "boolean", "nullable": True},
                "fields": {"type": "array", "items": {"type": "string"}},
                "threshold": {"type": "number", "default": 0.5},
                "where": {"type": "object", "properties": {"lat": {"type": "number"},
                                                           "lon": {"type": "number"}},
                          "required": ["lat"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Get the current time.",
                 "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_ARGS = {"city": "Paris", "unit": "celsius", "days": 3, "threshold": 0.25,
                "fields": ["temp", "wind"], "note": "«é» \"x\"\n"}
TOOL_RESULT = '{"temperature": 21.5, "condition": "sunny"}'


def tool_call(args, call_id="call_abc12", name="get_weather"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_conversation(args_as, content=None, call_id="call_abc12", result_id=None):
    """user asks, assistant calls get_weather, the tool answers, the assistant answers."""
    args = json.dumps(WEATHER_ARGS, ensure_ascii=False) if args_as == "string" else WEATHER_ARGS
    return [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [tool_call(args, call_id)]},
        {"role": "tool", "tool_call_id": result_id or call_id, "name": "get_weather",
         "content": TOOL_RESULT},
        {"role": "assistant", "content": "It is sunny and 21.5 °C in Paris."},
    ]


def base_cases(system=True):
    """What every template renders: one user turn, a system prompt, several turns."""
    cases = [
        ("user", [USER], True, {}),
        ("user_no_generation_prompt", [USER], False, {}),
        ("multi_turn", [USER, ANSWER, USER2], True, {}),
        ("ends_with_assistant", [USER, ANSWER], False, {}),
        ("tricky_text", [TRICKY, ANSWER, TRICKY], True, {}),
    ]
    if system:
        cases += [
            ("system_user", [SYSTEM, USER], True, {}),
            ("system_multi_turn", [SYSTEM, USER, ANSWER, USER2], True, {}),
            ("system_ends_with_assistant", [SYSTEM, USER, ANSWER], False, {}),
        ]
    return cases


def tool_cases(args_as, call_id="call_abc12", content=None, result_id=None):
    convo = tool_conversation(args_as, content, call_id, result_id)
    return [
        ("tools_defined", [SYSTEM, USER], True, {"tools": TOOLS}),
        ("tool_call_and_result", convo[:3], True, {"tools": TOOLS}),
        ("tool_round_trip", convo, False, {"tools": TOOLS}),
    ]


def parts(text):
    return [{"type": "text", "text": text}]


def user(content):
    return {"role": "user", "content": content}


def assistant(content, **fields):
    return {"role": "assistant", "content": content, **fields}


def calls(*tool_calls, **fields):
    """An assistant turn of tool calls; content only if given (some templates test for it)."""
    return {"role": "assistant", **fields, "tool_calls": list(tool_calls)}


def tool(content, **fields):
    return {"role": "tool", **fields, "content": content}


# Per template: the special tokens its tokenizer_config.json defines, and its cases as
# (name, messages, add_generation_prompt, extra keyword arguments). Cases named error_* must
# make the template raise.
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct.jinja": {
        "tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "cases": base_cases() + tool_cases("dict") + [
            ("tools_in_system", [SYSTEM, USER], True,
             {"tools": TOOLS, "tools_in_user_message": False}),
            ("builtin_tools", [SYSTEM, USER, calls(tool_call({"query": "weather Paris"},
                                                             name="brave_search"), content=None),
                               {"role": "ipython", "content": "Sunny."}], True,
             {"builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]}),
            ("date_string", [USER], True, {"date_string": "01 Jan 2025"}),
            ("error_two_tool_calls", [USER, calls(tool_call({"city": "Paris"}),
                                                  tool_call({"city": "Rome"}))], True,
             {"tools": TOOLS}),
        ],
    },
    "Qwen-Qwen2.5-7B-Instruct.jinja": {
        "tokens": {"eos_token": "<|im_end|>"},
        "cases": base_cases() + tool_cases("dict") + [
            ("tools_without_system", [USER], True, {"tools": TOOLS}),
            ("two_tool_results", [USER, calls(tool_call({"city": "Paris"}),
                                              tool_call({"city": "Rome"}), content=""),
                                  tool("sunny"), tool("rainy")], True, {"tools": TOOLS}),
        ],
    },
    "Qwen-Qwen3-0.6B.jinja": {
        "tokens": {"eos_token": "<|im_end|>"},
        "cases": base_cases() + tool_cases("dict", content="") + [
            ("think_in_content",
             [USER, assistant("<think>\nThe user asks about France.\n</think>\n\nParis."), USER2],
             True, {}),
            ("think_last_turn", [USER, assistant("<think>\nEasy.\n</think>\n\nParis.")], False, {}),
            ("reasoning_content",
             [USER, assistant("Paris.", reasoning_content="France's capital is Paris.")],
             False, {}),
            ("enable_thinking_false", [USER], True, {"enable_thinking": False}),
            ("string_arguments", tool_conversation("string", content="Checking."), False,
             {"tools": TOOLS}),
            ("tool_response_as_user", [USER, user("<tool_response>\nsunny\n</tool_response>")],
             True, {}),
        ],
    },
    "deepseek-ai-DeepSeek-V3.1.jinja": {
        "tokens": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        "cases": base_cases() + tool_cases("string") + [
            ("thinking", [SYSTEM, USER], True, {"thinking": True}),
            ("think_stripped", [USER, assistant("<think>hmm</think>Paris."), USER2], True, {}),
            ("two_systems", [SYSTEM, {"role": "system", "content": "Be brief."}, USER], True, {}),
            ("tool_call_with_content", tool_conversation("string", content="Let me check."), False,
             {"tools": TOOLS}),
        ],
    },
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": {
        "tokens": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
        "cases": base_cases() + tool_cases("string") + [
            ("think_stripped", [USER, assistant("<think>hmm</think>Paris."), USER2], True, {}),
            ("two_tool_calls", [USER, calls(tool_call('{"city": "Paris"}'),
                                            tool_call('{"city": "Rome"}'), content=None),
                                tool("sunny"), tool("rainy")], True, {}),
        ],
    },
    "google-gemma-2-2b-it.jinja": {
        "tokens": {"bos_token": "<bos>", "eos_token": "<eos>"},
        "cases": base_cases(system=False) + [
            ("error_system_role", [SYSTEM, USER], True, {}),
            ("error_not_alternating", [USER, USER2], True, {}),
        ],
    },
    "microsoft-Phi-3.5-mini-instruct.jinja": {
        "tokens": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
        "cases": base_cases() + [
            ("empty_system", [{"role": "system", "content": ""}, USER], True, {}),
        ],
    },
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": {
        "tokens": {"bos_token": "<s>", "eos_token": "</s>"},
        "cases": base_cases() + tool_cases("dict", call_id="abc123def") + [
            ("dict_tool_result",
             [USER, calls(tool_call({"city": "Paris"}, "abc123def")),
              tool({"content": {"t": 21, "ok": True, "x": None}}, tool_call_id="abc123def")],
             True, {"tools": TOOLS}),
            ("error_bad_call_id", tool_conversation("dict", call_id="short"), True,
             {"tools": TOOLS}),
            ("error_not_alternating", [USER, USER2], True, {}),
        ],
    },
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": {
        "tokens": {"bos_token": "<s>", "eos_token": "</s>"},
        "cases": base_cases() + tool_cases("dict", call_id="abc123def") + [
            ("content_parts", [{"role": "system", "content": parts("Be brief.")},
                               user(parts("Look:") + [{"type": "image_url"}]
                                    + parts(" what is it?")),
                               assistant(parts("A cat."))], False, {}),
            ("error_bad_part", [user([{"type": "audio"}])], True, {}),
            ("error_bad_call_id", tool_conversation("dict", call_id="short"), True,
             {"tools": TOOLS}),
        ],
    },
    "moonshotai-Kimi-K2.jinja": {
        "tokens": {"bos_token": "[BOS]", "eos_token": "[EOS]"},
        "cases": base_cases() + tool_cases("string", call_id="functions.get_weather:0") + [
            ("content_parts",
             [user(parts("Look:") + [{"type": "image_url", "image_url": {}}]
                   + parts("What is it?")),
              assistant(parts("A cat."))], True, {}),
        ],
    },
    "openai-gpt-oss-120b.jinja": {
        "tokens": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>"},
        "cases": base_cases() + tool_cases("dict", content="") + [
            ("developer_message", [{"role": "developer", "content": "Answer like a pirate."}, USER],
             True, {}),
            ("reasoning_effort_and_identity", [SYSTEM, USER], True,
             {"reasoning_effort": "high", "model_identity": "You are Tiny, a test model."}),
            ("builtin_tools", [USER], True,
             {"builtin_tools": ["browser", "python"], "tools": TOOLS}),
            ("thinking_then_tool_call",
             [USER, {"role": "assistant", "thinking": "I should call the tool.",
                     "tool_calls": [tool_call(WEATHER_ARGS)]}, tool(TOOL_RESULT)], True,
             {"tools": TOOLS}),
            ("thinking_dropped_after_final", [USER, assistant("Paris.", thinking="Think."), USER2],
             True, {}),
            ("training_last_turn", [USER, assistant("Paris.", thinking="Think.")], False, {}),
            ("error_channel_in_content", [USER, assistant("<|channel|>final<|message|>Paris.")],
             True, {}),
        ],
    },
}


def render(template, context):
    """The output, or the message of an exception the template raises on purpose."""
    try:
        return {"output": template.render(**context)}
    except jinja2.exceptions.UndefinedError:
        raise
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def context_of(tokens, messages, add_generation_prompt, extra):
    ctx = {"messages": messages, "tools": None, "documents": None,
           "add_generation_prompt": add_generation_prompt}
    ctx.update(tokens)
    ctx.update(extra)
    return ctx


# --- harmony ----------------------------------------------------------------------------------

# Function tool of upstream's test_browser_and_function_tool, in OpenAI form.
LOOKUP_WEATHER = {"type": "function", "function": {
    "name": "lookup_weather",
    "description": "Use this tool to lookup the weather in a given location. Call it with the "
                   "parameter 'location', can be any textual description of a location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}

# The upstream vectors that a jinja rendering can reproduce: the template always writes the
# date line, so only those with "Current date: 2025-06-28" and no messages match whole; the
# conversation of test_dropping_cot_by_default matches after the system message. Rendering an
# empty message list needs undefined attributes to be undefined rather than errors (jinja2's
# ChainableUndefined), which is what the C renderer does.
HARMONY = [
    ("test_no_tools", "exact", {"messages": []}),
    ("test_browser_tool_only", "exact", {"messages": [], "builtin_tools": ["browser"]}),
    ("test_browser_and_python_tool", "exact",
     {"messages": [], "builtin_tools": ["browser", "python"]}),
    ("test_browser_and_function_tool", "exact",
     {"messages": [], "builtin_tools": ["browser"], "tools": [LOOKUP_WEATHER]}),
    ("test_dropping_cot_by_default", "suffix", {"messages": [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant",
         "thinking": "User asks: “What is 2 + 2?” Simple arithmetic. Provide answer.",
         "content": "2 + 2 equals 4."},
        {"role": "user", "content": "What about 9 / 2?"}]}),
]


def harmony_cases(env, source, harmony_dir):
    template = env.from_string(source)
    cases = []
    for name, match, extra in HARMONY:
        ctx = {"tools": None, "documents": None, "add_generation_prompt": True}
        ctx.update(extra)
        got = template.render(**ctx).rstrip()
        with open(os.path.join(harmony_dir, name + ".txt"), encoding="utf-8") as f:
            want = f.read().replace("\r\n", "\n").rstrip()
        if not (got == want if match == "exact" else got.endswith(want)):
            sys.exit(f"harmony/{name}.txt: jinja2 does not reproduce it")
        cases.append({"name": name, "file": f"harmony/{name}.txt", "match": match, "context": ctx})
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--templates", default=os.path.join(REPO, "..", "shared", "data", "templates"))
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "fixtures", "templates"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    now = NOW.isoformat()
    for template, family in FAMILIES.items():
        with open(os.path.join(args.templates, template), encoding="utf-8") as f:
            compiled = env.from_string(f.read())
        cases = []
        for name, messages, agp, extra in family["cases"]:
            case = {"name": name, "context": context_of(family["tokens"], messages, agp, extra)}
            case.update(render(compiled, case["context"]))
            if name.startswith("error_") != ("error" in case):
                sys.exit(f"{template}: case {name}: {case}")
            cases.append(case)
        out = os.path.join(args.out, template[:-len(".jinja")] + ".json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"template": template, "now": now, "cases": cases}, f, ensure_ascii=False,
                      indent=1)
            f.write("\n")
        print(f"{out}: {len(cases)} cases")

    with open(os.path.join(args.templates, "openai-gpt-oss-120b.jinja"), encoding="utf-8") as f:
        source = f.read()
    cases = harmony_cases(environment(jinja2.ChainableUndefined), source,
                          os.path.join(args.templates, "harmony"))
    out = os.path.join(args.out, "harmony.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"template": "openai-gpt-oss-120b.jinja", "now": now, "cases": cases}, f,
                  ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
