"""Prompt lookup's steps over a known greedy continuation, counted as `moe run` / `moe bench
--spec ngram` count them, written from the rule in src/engine/engine.h (moe_draft_ngram) and the
step loop's budget (cli/generate.c), not from their code.

usage: ngram_steps.py IDS N_PROMPT N_GEN N_DRAFT
IDS: the prompt's ids then the greedy ones, comma separated (what `moe run --print-ids` prints).
Prints the drafts verified and kept at each draft position and the tokens per step:
"D1 A1 D2 A2 ... TOKENS_PER_STEP"."""
import sys

NGRAM_MAX = 3


def draft(hist, want):
    """The tokens after the most recent earlier occurrence of the longest suffix (3, else 2, else
    1 tokens) that has any: at most `want` of them."""
    for length in range(min(NGRAM_MAX, len(hist)), 0, -1):
        suffix = hist[len(hist) - length:]
        for at in range(len(hist) - length - 1, -1, -1):
            if hist[at:at + length] == suffix:
                out = hist[at + length:at + length + want]
                if out:
                    return out
    return []


def main():
    ids = [int(x) for x in sys.argv[1].split(",")]
    n_prompt, n_gen, n_draft = (int(x) for x in sys.argv[2:5])
    prompt, greedy = ids[:n_prompt], ids[n_prompt:n_prompt + n_gen]
    assert len(greedy) == n_gen, "fewer greedy ids than asked for"
    drafted, accepted = [0] * n_draft, [0] * n_draft
    steps, i = 0, 0  # greedy[i]: the token this step feeds (i + 1 generated so far)
    while True:
        left = n_gen - (i + 1)  # tokens still to generate: each draft kept is one of them,
        want = 0 if left <= 1 else min(n_draft, left - 1)  # and the step's own pick another
        drafts = draft(prompt + greedy[:i + 1], want) if want else []
        steps += 1
        kept = 0
        for k, token in enumerate(drafts):
            drafted[k] += 1
            if greedy[i + 1 + k] != token:
                break
            accepted[k] += 1
            kept += 1
        i += kept + 1
        if i >= n_gen:
            break
    print(" ".join(f"{d} {a}" for d, a in zip(drafted, accepted)), f"{n_gen / steps:.4f}")


main()
