"""The prompts of benchmarks/bench_spec.py, all byte tokens of the training corpus's held-out split (the stdlib).

    code_prompts     the first prompt_bytes bytes of the first `count` held-out files ("# file: NAME" first)
    chat_prompts     multi-turn chats rendered by the server's plain chat template (server/protocol.render_chat):
                     a system message, then user / assistant turns whose assistant replies are consecutive
                     pieces of one held-out file, ending on a user turn and the assistant's cue; the model's
                     reply is then the file's next piece, with chat markers all through its context
    context_prompts  the held-out files concatenated; prompt i of length N is the N tokens before the i-th
                     cut point, so every length continues the same text and only the context before it grows
"""
from __future__ import annotations

from latentmoe_lab.server.protocol import render_chat
from latentmoe_lab.training.corpus import is_held_out, source_files, stdlib_root

HELD_OUT_FRACTION = 0.02  # the corpus's default split (training/corpus.load_corpus), which `make model-mtp` uses
CHAT_SYSTEM = "You are a Python assistant. Reply with the next lines of the file, as code."


def held_out_files() -> list[tuple[str, str]]:
    """(relative path, text) of every held-out file of the corpus, in the corpus's order."""
    root = stdlib_root()
    files = []
    for path in source_files(root):  # the split is chosen by path alone, so only the held-out files are read
        relative = path.relative_to(root).as_posix()
        if is_held_out(relative, HELD_OUT_FRACTION):
            files.append((relative, path.read_bytes().decode("utf-8", errors="replace")))
    return files


def code_prompts(count: int, prompt_bytes: int) -> list[list[int]]:
    """The first prompt_bytes bytes (byte tokens) of the first `count` held-out corpus files."""
    return [list(f"# file: {name}\n{text}".encode("utf-8")[:prompt_bytes])
            for name, text in held_out_files()[:count]]


def chat_prompts(count: int, prompt_bytes: int, turns: int = 2) -> list[list[int]]:
    """`count` chats of about prompt_bytes bytes: the system message, then `turns` (user, assistant) pairs and a
    last user turn; the assistant replies are consecutive pieces of one held-out file (the last files first,
    so they are not code_prompts' files), every user turn asks for the next piece."""
    piece = max(16, prompt_bytes // (turns + 1))
    chats = []
    for name, text in reversed(held_out_files()):
        if len(chats) == count:
            break
        replies = line_pieces(text, piece, turns + 1)
        if len(replies) < turns + 1:  # too short for the turns and a reply after them
            continue
        messages = [{"role": "system", "content": CHAT_SYSTEM}]
        for turn in range(turns):
            ask = f"Show me the start of {name}." if turn == 0 else "Go on."
            messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": replies[turn]}]
        messages.append({"role": "user", "content": "Go on."})
        chats.append(list(render_chat(messages).encode("utf-8")))
    if len(chats) < count:
        raise ValueError(f"chat prompts: the held-out split has only {len(chats)} files long enough, asked for {count}")
    return chats


def line_pieces(text: str, size: int, count: int) -> list[str]:
    """Up to `count` consecutive pieces of text, whole lines each, every one at least `size` characters."""
    pieces, current = [], ""
    for line in text.splitlines(keepends=True):
        current += line
        if len(current) >= size:
            pieces.append(current.rstrip("\n"))  # the template puts a newline after every message
            current = ""
            if len(pieces) == count:
                break
    return pieces


def context_prompts(count: int, length: int, longest: int) -> list[list[int]]:
    """`count` prompts of `length` byte tokens: prompt i ends at the i-th cut point of the held-out files
    concatenated ("# file: NAME" before each), the cut points `longest` tokens apart (each at a line start),
    so a prompt of every length up to `longest` continues the same text."""
    stream = "".join(f"# file: {name}\n{text}\n" for name, text in held_out_files()).encode("utf-8")
    cuts, position = [], longest
    while len(cuts) < count:
        newline = stream.find(b"\n", position)
        if newline < 0 or newline + 1 + 256 > len(stream):  # keep room for the continuation after the cut
            raise ValueError(f"context prompts: the held-out split holds {len(stream)} bytes, too few for "
                             f"{count} prompts of {longest} tokens")
        cuts.append(newline + 1)
        position = newline + 1 + longest
    if length > longest:
        raise ValueError(f"length: ({length}) must be <= longest ({longest})")
    return [list(stream[cut - length:cut]) for cut in cuts]


def describe_prompts(prompts: list[list[int]]) -> str:
    """'N prompts of A-B tokens' for the printed header."""
    sizes = sorted(map(len, prompts))
    span = f"{sizes[0]}" if sizes[0] == sizes[-1] else f"{sizes[0]}-{sizes[-1]}"
    return f"{len(prompts)} prompts of {span} tokens"

