"""Tiny local tokenizer directories with chat templates, and generated tool-use conversations, for the
transcript tests (no hub access). A byte-level BPE is trained in memory on text like the conversations,
so merges cross message boundaries as a real tokenizer's do, and saved as a PreTrainedTokenizerFast dir.

Templates (transformers renders them with trim_blocks and lstrip_blocks, hence the explicit '\\n'):
  CHATML       ChatML with tools, `{% generation %}` around the generated part (content, tool calls,
               <|im_end|>); the newline after <|im_end|> is template glue, outside it.
  KIMI         the Kimi K2 layout (<|im_user|>user<|im_middle|>...<|im_end|>, a tool_declare block, calls in
               <|tool_calls_section_begin|>...), no generation marks, eos "[EOS]": generation stops at
               <|im_end|>, which only generation_config.json names (as in Kimi K2's directory).
  CHATML_EOS   CHATML that writes [EOS] after each assistant <|im_end|>, outside the generation block, and
               generation_config.json names [EOS] as a stop token too: a turn ends at its <|im_end|>,
               the first stop token, where generation stopped.
  KIMI_THINKING KIMI with reasoning as Kimi K2 Thinking / K2.5 render it (our reading of their published
               templates): the generation prompt ends with "<think>" (the engine prefills it); assistant
               messages after the last user message render <think>reasoning</think>, earlier ones an
               empty <think></think>.
  FIRST_SYSTEM CHATML that renders a system message only in first place (as many templates do): a system
               hint renders as nothing (must be refused; a user hint works).
  LAST_MARKED  renders the final message differently: prefixes are not prefixes (must be refused).
  MARKS_ONLY   CHATML without the generation-prompt branch: only its `{% generation %}` marks tell the
               role header from the generated tokens.
  NO_PROMPT    MARKS_ONLY without the marks: nothing tells them apart (must be refused).
"""

import json
import os
import random

SPECIAL = ["[BOS]", "[EOS]", "<|im_start|>", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
           "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"]

CHATML = (
    "{%- if tools %}<|im_start|>system{{ '\\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{{ '\\n' }}{% endif %}# Tools{{ '\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    "<|im_end|>{{ '\\n' }}"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system{{ '\\n' }}{{ messages[0].content }}<|im_end|>{{ '\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{{ '\\n' }}"
    "{% generation %}{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{{ '\\n' }}{{ call.function | tojson }}{{ '\\n' }}</tool_call>"
    "{%- endfor %}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{%- else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")

CHATML_EOS = CHATML.replace("<|im_end|>{% endgeneration %}", "<|im_end|>{% endgeneration %}[EOS]")
assert CHATML_EOS != CHATML

KIMI = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0].role != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message.role == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>tool<|im_middle|>{%- endif -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{{ message.content or '' }}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>"
    "{{ call.function.arguments | tojson }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>"
    "{%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}{{ '\\n' }}{{ message.content }}"
    "{%- else -%}{{ message.content }}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

KIMI_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    + KIMI.replace("{%- if message.role == 'assistant' and message.tool_calls -%}",
                   "{%- if message.role == 'assistant' -%}<think>{% if loop.index0 > ns.last_user %}"
                   "{{ message.reasoning_content or '' }}{% endif %}</think>{%- endif -%}"
                   "{%- if message.role == 'assistant' and message.tool_calls -%}")
    .replace("<|im_assistant|>assistant<|im_middle|>{%- endif -%}", "<|im_assistant|>assistant<|im_middle|><think>{%- endif -%}"))
assert KIMI_THINKING.count("<think>") == 2

FIRST_SYSTEM = CHATML.replace("{%- if message.role == 'system' and loop.first %}", "{%- if message.role == 'system' %}")
assert FIRST_SYSTEM != CHATML

LAST_MARKED = ("{%- for message in messages %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content or '' }}"
               "{% if loop.last %} (last){% endif %}<|im_end|>{{ '\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")

MARKS_ONLY = CHATML.replace("{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}", "")
assert MARKS_ONLY != CHATML
NO_PROMPT = MARKS_ONLY.replace("{% generation %}", "").replace("{% endgeneration %}", "")
assert "generation" not in NO_PROMPT

TOOLS = ("search", "calc", "weather", "clock", "translate", "maps")


def tool_schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                             "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}


def conversation(rng: random.Random, index: int) -> dict:
    """A tool-use conversation; calls to a tool that is not available get a hint and lower the reward."""
    available = sorted(rng.sample(TOOLS, 3))
    messages = [{"role": "system", "content": f"Use the tools: {', '.join(available)}."},
                {"role": "user", "content": f"Task {rng.randint(10, 99)}: find it."}]
    feedback, wrong = [], 0
    for k in range(rng.randint(1, 3)):
        tool = rng.choice(TOOLS)
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": rng.choice(["", "Let me check."]),
                         "tool_calls": [{"id": call_id, "type": "function",
                                         "function": {"name": tool, "arguments": {"x": rng.randint(1, 9)}}}]})
        if tool not in available:
            wrong += 1
            feedback.append({"message": len(messages) - 1, "hint": f"Reminder: available tools: {', '.join(available)}"})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "ok" if tool in available else "Tool not found"})
    messages.append({"role": "assistant", "content": f"The answer is {rng.randint(1, 99)}."})
    return {"messages": messages, "tools": [tool_schema(t) for t in available], "reward": 1.0 - 0.5 * wrong,
            "group": f"task-{index // 4}", "feedback": feedback}


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [conversation(rng, i) for i in range(n)]


def _corpus() -> list[str]:
    text = [json.dumps(c) for c in conversations(40, seed=123)]
    return text + ["Reminder: available tools: " + ", ".join(TOOLS), "## Return of call_0\nok", "You are Kimi"] * 5


def make_tokenizer_dir(path: str, template: str | None, eos: str = "<|im_end|>",
                       generation_eos: str | None = None, vocab_size: int = 448) -> str:
    """Save a trained byte-level BPE with `template` (None: no chat template) as a tokenizer directory;
    `generation_eos`: a token written to generation_config.json's eos_token_id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token=eos, chat_template=template)
    fast.save_pretrained(path)
    if generation_eos is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": fast.convert_tokens_to_ids(generation_eos)}, f)
    return path
