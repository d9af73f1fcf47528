"""launch/prepare_rollouts.py: chat transcripts -> rollouts through the tokenizer directory's chat template.

Oracles: transformers' `return_assistant_tokens_mask=True` for the assistant ranges (a template with
`{% generation %}`), decoding each assistant range against the message as the template renders it, and
the tokenizer's rendering of the conversation with the hint message inserted against the teacher rows
that runtime/posttrain/rollout_batch.py builds from the written file."""

import copy
import json
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from chat_tokenizers import (CHATML, CHATML_EOS, FIRST_SYSTEM, KIMI, KIMI_THINKING, LAST_MARKED, MARKS_ONLY, NO_PROMPT,
                             conversations, make_tokenizer_dir)
from launch.prepare_rollouts import GRPO_EPS, load_tokenizer, main
from runtime.posttrain import transcripts
from runtime.posttrain.rollout_batch import build_micro_batch
from runtime.posttrain.rollouts import read_rollouts
from runtime.posttrain.transcripts import parse_conversation, render_conversation


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"chatml": make_tokenizer_dir(str(root / "chatml"), CHATML),
            "chatml_eos": make_tokenizer_dir(str(root / "chatml_eos"), CHATML_EOS, generation_eos="[EOS]"),
            "kimi": make_tokenizer_dir(str(root / "kimi"), KIMI, eos="[EOS]", generation_eos="<|im_end|>"),
            "thinking": make_tokenizer_dir(str(root / "thinking"), KIMI_THINKING, eos="[EOS]", generation_eos="<|im_end|>"),
            "last": make_tokenizer_dir(str(root / "last"), LAST_MARKED),
            "first_system": make_tokenizer_dir(str(root / "first_system"), FIRST_SYSTEM),
            "marks_only": make_tokenizer_dir(str(root / "marks_only"), MARKS_ONLY),
            "no_prompt": make_tokenizer_dir(str(root / "no_prompt"), NO_PROMPT),
            "none": make_tokenizer_dir(str(root / "none"), None)}


def _multi_call() -> dict:
    """Two tool calls in one assistant message, two tool answers, a user turn in between, no feedback."""
    call = lambda i, name: {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": {"x": i}}}
    return {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": [call(1, "weather"), call(2, "clock")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."}], "reward": 1.0}


def _chats(n=12) -> list[dict]:
    return conversations(n) + [_multi_call()]


def _prepare(tmp_path, tokenizer_dir, chats, *extra) -> tuple[int, list[dict]]:
    inp, out = tmp_path / "chats.jsonl", tmp_path / "rollouts.jsonl"
    inp.write_text("".join(json.dumps(c) + "\n" for c in chats))
    code = main(["--tokenizer", tokenizer_dir, "--in", str(inp), "--out", str(out), *extra])
    return code, [json.loads(line) for line in open(out)] if code == 0 else []


def _expected_generation(template: str, message: dict) -> str:
    """What the model generated for an assistant message, written out by hand for each test template."""
    calls = message.get("tool_calls") or []
    if template == "chatml":
        return (message["content"] or "") + "".join(
            f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in calls) + "<|im_end|>"
    body = "".join(f"<|tool_call_begin|>{c['id']}<|tool_call_argument_begin|>{json.dumps(c['function']['arguments'])}"
                   f"<|tool_call_end|>" for c in calls)
    return (message["content"] or "") + (f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>" if calls else "") \
        + "<|im_end|>"


@pytest.mark.parametrize("template", ["chatml", "chatml_eos", "marks_only"])
def test_assistant_ranges_equal_transformers_mask(tmp_path, dirs, template):
    """Template oracle: with `{% generation %}`, the assistant turns are exactly transformers' assistant mask
    (system prompts, tool calls, several calls in one message, tool answers, multi-turn; chatml_eos: a
    second stop token the template writes after <|im_end|> stays outside the turn; marks_only: no
    generation-prompt branch, so only the marks keep the role header out of the turn)."""
    chats = _chats()
    code, records = _prepare(tmp_path, dirs[template], chats)
    assert code == 0 and len(records) == len(chats)
    tokenizer = AutoTokenizer.from_pretrained(dirs[template], local_files_only=True)
    for chat, record in zip(chats, records):
        out = tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert record["tokens"] == out["input_ids"]
        mask = np.zeros(len(record["tokens"]), dtype=int)
        for turn in record["turns"]:
            mask[turn["start"]:turn["end"]] += turn["role"] == "assistant"
        assert mask.tolist() == out["assistant_masks"]
        assert sum(out["assistant_masks"]) > 0


@pytest.mark.parametrize("template", ["chatml", "kimi"])
def test_assistant_ranges_decode_to_the_message(tmp_path, dirs, template):
    """Decoding each assistant range gives the content and tool calls as rendered, and the end-of-turn
    token; the role header and the glue after <|im_end|> are outside it. Kimi's eos is [EOS]: its turns
    end at <|im_end|> because generation_config.json says generation stops there."""
    chats = _chats()
    code, records = _prepare(tmp_path, dirs[template], chats)
    tokenizer = AutoTokenizer.from_pretrained(dirs[template], local_files_only=True)
    assert code == 0
    for chat, record in zip(chats, records):
        assert len(record["turns"]) == len(chat["messages"])
        for message, turn in zip(chat["messages"], record["turns"]):
            assert turn["role"] == message["role"]
            if message["role"] == "assistant":
                text = tokenizer.decode(record["tokens"][turn["start"]:turn["end"]])
                assert text == _expected_generation(template, message)


@pytest.mark.parametrize("template,role", [("chatml", "system"), ("chatml", "user"), ("kimi", "system")])
def test_teacher_rows_equal_the_rendering_with_the_hint(tmp_path, dirs, template, role):
    """Hint oracle: the teacher sequence the posttrainer builds (runtime/posttrain/rollout_batch.py, from the written
    file: the shared prefix row, then the item's row) is the tokenizer's rendering of the conversation with the hint message inserted before the
    flagged message, cut after that message's generated tokens."""
    chats = _chats()
    code, _ = _prepare(tmp_path, dirs[template], chats, "--hint-role", role)
    assert code == 0
    tokenizer = AutoTokenizer.from_pretrained(dirs[template], local_files_only=True)
    trajs = read_rollouts(str(tmp_path / "rollouts.jsonl"), len(tokenizer), 4096)
    checked = 0
    for chat, traj in zip(chats, trajs):
        if not traj.feedback:
            continue
        batch = build_micro_batch([traj], 1, 1, len(traj.feedback), cp=1, cp_rank=0)
        for row, item in enumerate(traj.feedback):
            hint = {"role": role, "content": chat["feedback"][row]["hint"]}
            i = item.turn
            hinted = tokenizer.apply_chat_template(chat["messages"][:i] + [hint] + chat["messages"][i:],
                                                   tools=chat["tools"])["input_ids"]
            length = traj.turns[i].end + len(item.hint)
            own = batch.item_doc_IL[0, batch.item_positions_S] == row  # item `row`'s tokens in the packed item row
            teacher = batch.teacher_inputs_BS[0, :item.at].tolist() + batch.item_inputs_IS[0, own][:length - item.at].tolist()
            assert teacher == hinted[:length]  # the shared prefix, then the item's tokens: hint + tokens[at:end]
            assert len(hinted) == len(traj.tokens) + len(item.hint)
            checked += 1
    assert checked >= 5


def test_advantages_logprobs_and_summary(tmp_path, dirs, capsys):
    """grpo: (reward - group mean) / (sample std + eps), a group of one gets 0 and is counted; raw: the
    reward; a given advantage wins. Log-probs land on each message's generated tokens."""
    chats = conversations(8)  # groups task-0 and task-1, 4 conversations each
    chats[0]["advantage"] = 7.0
    lone = copy.deepcopy(chats[1])
    lone["group"] = "alone"
    code, records = _prepare(tmp_path, dirs["chatml"], chats + [lone])
    assert code == 0
    summary = capsys.readouterr().out.strip()
    assert _prepare(tmp_path, dirs["first_system"], chats, "--hint-role", "user")[0] == 0  # a user hint renders
    for k in range(1, 8):
        rewards = [c["reward"] for c in chats[k // 4 * 4:k // 4 * 4 + 4] if "advantage" not in c]
        expected = (chats[k]["reward"] - np.mean(rewards)) / (np.std(rewards, ddof=1) + GRPO_EPS)
        assert records[k]["advantage"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert records[0]["advantage"] == 7.0 and records[8]["advantage"] == 0.0
    flagged = sum(len(c["feedback"]) for c in chats + [lone])
    tokens = sum(len(r["tokens"]) for r in records)
    assistant = sum(t["end"] - t["start"] for r in records for t in r["turns"] if t["role"] == "assistant")
    assert summary == (f"{tmp_path / 'rollouts.jsonl'}: 9 conversations -> 9 rollouts, {tokens:,} tokens "
                       f"({assistant:,} assistant), {flagged} flagged turns, dropped 0; 1 in groups of one (advantage 0)")
    code, raw = _prepare(tmp_path, dirs["chatml"], chats, "--advantage", "raw")
    assert [r["advantage"] for r in raw] == [7.0] + [c["reward"] for c in chats[1:]]

    chat = _multi_call()
    turns = {i: (k + 1) for k, i in enumerate([2, 5, 7])}
    chat["logprobs"] = {}
    code, (record,) = _prepare(tmp_path, dirs["chatml"], [chat])
    for i in turns:  # the right counts, read back from the first pass
        turn = record["turns"][i]
        chat["logprobs"][str(i)] = [-0.5 * turns[i]] * (turn["end"] - turn["start"])
    code, (record,) = _prepare(tmp_path, dirs["chatml"], [chat])
    expected = np.zeros(len(record["tokens"]))
    for i in turns:
        expected[record["turns"][i]["start"]:record["turns"][i]["end"]] = -0.5 * turns[i]
    assert code == 0 and record["logprobs"] == expected.tolist()


def test_dropped_conversations(tmp_path, dirs, capsys):
    """No assistant message, and (with --drop-long) over --max-len: dropped and counted, not refused."""
    chats = _chats(4)
    lengths = [len(r["tokens"]) for r in _prepare(tmp_path, dirs["chatml"], chats)[1]]
    capsys.readouterr()
    no_answer = {"messages": [{"role": "user", "content": "hi"}], "reward": 0.0}
    limit = sorted(lengths)[-2]  # the longest one is dropped (teacher rows are shorter than --max-len here)
    code, records = _prepare(tmp_path, dirs["chatml"], chats + [no_answer], "--max-len", str(limit + 40), "--drop-long")
    line = capsys.readouterr().out
    assert code == 0 and len(records) == len([n for n in lengths if n <= limit + 40])
    assert f"dropped {len(chats) + 1 - len(records)} (" in line and "1 no assistant message" in line


BAD = {  # name: (mutation of the third conversation, words the one-line error must contain)
    "feedback_on_user": (lambda c: c["feedback"].append({"message": 1, "hint": "x"}),
                         ["line 3", "feedback[", ".message=1 is a user message"]),
    "feedback_out_of_range": (lambda c: c["feedback"].append({"message": 40, "hint": "x"}),
                              ["line 3", "message=40 is not a message index in [0, "]),
    "unknown_role": (lambda c: c["messages"][1].update(role="developer"),
                     ["line 3", "messages[1].role='developer' is not one of"]),
    "logprobs_length": (lambda c: c.update(logprobs={str(i): [-1.0] * 3 for i, m in enumerate(c["messages"])
                                                     if m["role"] == "assistant"}),
                        ["line 3", "3 values for the", "generated tokens of message 2"]),
    "too_long": (lambda c: c["messages"][1].update(content="word " * 300),
                 ["line 3", "is longer than --max-len=400"]),
    "too_long_no_hint": (lambda c: (c["messages"][1].update(content="word " * 300), c["feedback"].clear()),
                         ["line 3", "is longer than --max-len=400", "(the conversation; it has no hint)"]),
    "no_reward": (lambda c: c.pop("reward"), ["line 3", "neither 'advantage' nor 'reward'"]),
    "empty_final_answer": (lambda c: c["messages"].append({"role": "assistant", "content": ""}),
                           ["line 3", "the final assistant message is empty", "end-of-turn-only turn"]),
    "blank_hint": (lambda c: c.update(feedback=[{"message": 2, "hint": "  \t "}]),
                   ["line 3", "feedback[0].hint: expected a string with text (not only white space)"]),
    "flagged_empty_middle_answer": (lambda c: (c["messages"][2].update(content="", tool_calls=None),
                                               c.update(feedback=[{"message": 2, "hint": "check the tools"}])),
                                    ["line 3", "feedback[0].message=2 is an empty assistant message",
                                     "only target would be the end-of-turn token"]),
}


@pytest.mark.parametrize("case", list(BAD) + ["invalid_json", "no_template", "not_a_prefix", "hint_not_rendered",
                                  "no_generation_prompt"])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, dirs, capsys, case):
    chats = conversations(4)
    assert chats[2]["messages"][2]["role"] == "assistant"
    tokenizer, words = dirs["chatml"], ["line 3"]
    if case in BAD:
        mutate, words = BAD[case]
        mutate(chats[2])
    lines = [json.dumps(c) for c in chats]
    if case == "invalid_json":
        lines[2] = lines[2][:-1]
        words = ["line 3: malformed JSON"]
    elif case == "no_template":
        tokenizer, words = dirs["none"], ["has no chat template"]
    elif case == "no_generation_prompt":
        tokenizer, words = dirs["no_prompt"], ["--tokenizer", "neither {% generation %} marks nor an "
                                               "add_generation_prompt branch", "role header"]
    elif case == "not_a_prefix":
        tokenizer, words = dirs["last"], ["line 1: message 1:", "renders the earlier messages differently"]
    elif case == "hint_not_rendered":
        line = next(k for k, c in enumerate(chats) if c["feedback"]) + 1
        tokenizer, words = dirs["first_system"], [f"line {line}: feedback on message", "does not render a system hint message there", "--hint-role user"]
    inp, out = tmp_path / "chats.jsonl", tmp_path / "rollouts.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    assert main(["--tokenizer", tokenizer, "--in", str(inp), "--out", str(out), "--max-len", "400"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert all(w in err for w in words), err
    assert os.listdir(tmp_path) == ["chats.jsonl"]


@pytest.mark.parametrize("template", ["chatml", "kimi"])
def test_piecewise_cuts_equal_whole_prefix_tokenization(dirs, template, monkeypatch):
    """The linear path (pieces between control tokens tokenized once) gives the same ranges as tokenizing
    every prefix rendering whole; and a token straddling a cut is refused on both paths."""
    tokenizer, eot = load_tokenizer(dirs[template], False)
    convs = [parse_conversation(c) for c in _chats()]
    fast = [render_conversation(tokenizer, c, eot) for c in convs]
    monkeypatch.setattr(transcripts, "_cuts_by_pieces", lambda *args: None)
    assert [render_conversation(tokenizer, c, eot) for c in convs] == fast
    monkeypatch.undo()
    glued = parse_conversation({"messages": [{"role": "user", "content": "Remin"}, {"role": "user", "content": "der"}]})
    glue = "{% for m in messages %}{{ m.content }}{% endfor %}"  # "Remin" + "der": no control token between
    ids = transcripts.encode(tokenizer, ["Remin", "Reminder"])
    assert ids[1][:len(ids[0])] != ids[0]  # "Reminder" is one token (else this case proves nothing)
    monkeypatch.setattr(tokenizer, "chat_template", glue)
    for path in ("pieces", "exact"):
        if path == "exact":
            monkeypatch.setattr(transcripts, "_cuts_by_pieces", lambda *args: None)
        with pytest.raises(ValueError, match="message 1: a token straddles the boundary"):
            render_conversation(tokenizer, glued, eot)


def _thinking_chat(second_user_turn: bool) -> dict:
    call = {"id": "c0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "reasoning_content": "Need the weather tool.", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
                {"role": "assistant", "reasoning_content": "It said sunny.", "content": "Sunny."}]
    if second_user_turn:
        messages += [{"role": "user", "content": "Tomorrow?"},
                     {"role": "assistant", "reasoning_content": "Guess.", "content": "Probably sunny."}]
    return {"messages": messages, "reward": 1.0, "feedback": [{"message": 3, "hint": "Cite the tool."}]}


def test_thinking_template(tmp_path, dirs, capsys):
    """A Kimi K2 Thinking / K2.5 style template: the generation prompt prefills <think>, so a turn is the
    reasoning after it, </think>, the content and calls, <|im_end|>; a system hint renders as an
    insertion. A user hint becomes the last user message, which empties the reasoning of the turns
    before it, and a second user turn does the same to the first turn's reasoning: both refused."""
    chat = _thinking_chat(False)
    code, (record,) = _prepare(tmp_path, dirs["thinking"], [chat])
    tokenizer = AutoTokenizer.from_pretrained(dirs["thinking"], local_files_only=True)
    assert code == 0
    for i, turn in enumerate(record["turns"]):
        if turn["role"] == "assistant":
            message = chat["messages"][i]
            assert tokenizer.decode(record["tokens"][turn["start"]:turn["end"]]) == \
                message["reasoning_content"] + "</think>" + _expected_generation("kimi", message)
    (item,) = record["feedback"]
    hinted = chat["messages"][:3] + [{"role": "system", "content": "Cite the tool."}] + chat["messages"][3:]
    assert tokenizer.apply_chat_template(hinted)["input_ids"] == \
        record["tokens"][:item["at"]] + item["hint"] + record["tokens"][item["at"]:]
    assert _prepare(tmp_path, dirs["thinking"], [chat], "--hint-role", "user")[0] == 2
    assert "line 1: feedback on message 3: the template does not render a user hint message as an insertion" \
        in capsys.readouterr().err
    assert _prepare(tmp_path, dirs["thinking"], [_thinking_chat(True)])[0] == 2
    assert "line 1: message 2: the chat template renders the earlier messages differently" in capsys.readouterr().err
    without_reasoning = _thinking_chat(True)
    for m in without_reasoning["messages"]:
        m.pop("reasoning_content", None)
    assert _prepare(tmp_path, dirs["thinking"], [without_reasoning])[0] == 0


def test_split_user_turns(tmp_path, dirs, capsys):
    """--split-user-turns: one rollout per user message, rendered as the engine rendered it while answering
    that message (earlier turns' reasoning emptied), only the messages after it tracked; feedback follows
    its message into its rollout (turn index renumbered), the advantage its conversation."""
    chat = _thinking_chat(True)
    chat["feedback"].append({"message": 5, "hint": "Say you guess."})
    chat["group"] = "g"
    other = copy.deepcopy(chat)
    other["reward"] = 0.0
    code, records = _prepare(tmp_path, dirs["thinking"], [chat, other], "--split-user-turns")
    assert code == 0 and len(records) == 4
    assert capsys.readouterr().out.split(": ", 1)[1].startswith("2 conversations -> 4 rollouts")
    tokenizer = AutoTokenizer.from_pretrained(dirs["thinking"], local_files_only=True)
    first, second = records[:2]
    assert first["tokens"] == tokenizer.apply_chat_template(chat["messages"][:4])["input_ids"]
    assert second["tokens"] == tokenizer.apply_chat_template(chat["messages"])["input_ids"]
    assert [t["role"] for t in first["turns"]] == ["user", "assistant", "tool", "assistant"]
    (turn,) = second["turns"]
    assert tokenizer.decode(second["tokens"][turn["start"]:turn["end"]]) == "Guess.</think>Probably sunny.<|im_end|>"
    assert [f["turn"] for f in first["feedback"]] == [3] and [f["turn"] for f in second["feedback"]] == [0]
    (item,) = second["feedback"]
    hinted = chat["messages"][:5] + [{"role": "system", "content": "Say you guess."}] + chat["messages"][5:]
    assert tokenizer.apply_chat_template(hinted)["input_ids"] == \
        second["tokens"][:item["at"]] + item["hint"] + second["tokens"][item["at"]:]
    expected = 0.5 / (2 ** -0.5 + GRPO_EPS)  # rewards 1 and 0: mean 0.5, sample std 2 ** -0.5 (each counted once)
    assert [r["advantage"] for r in records] == pytest.approx([expected, expected, -expected, -expected], rel=1e-12)


def test_template_without_generation_prompt_or_marks_is_refused_per_message(dirs):
    """The rendering-level check behind --tokenizer's: a template whose generation prompt renders nothing
    and that has no marks names the first assistant message instead of training its role header."""
    tokenizer = AutoTokenizer.from_pretrained(dirs["no_prompt"], local_files_only=True)
    conv = parse_conversation(conversations(1)[0])
    with pytest.raises(ValueError, match="^message 2: the chat template renders no generation prompt"):
        render_conversation(tokenizer, conv, {tokenizer.eos_token_id})
