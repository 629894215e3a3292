"""bench.lookup's offline replay of prompt-lookup drafting: the latest earlier match of the last tokens is copied,
and a row needs one verifying pass per run of accepted draft tokens plus the model's own next one."""

from bench.lookup import draft, passes


def test_the_draft_copies_what_followed_the_latest_match_of_the_longest_tail():
    assert draft([1, 2, 3, 4, 9, 1, 2, 5, 6, 1, 2], k=2) == [5, 6]     # the latest [1, 2], not the first
    assert draft([7, 2, 3, 8, 1, 2, 3], k=3) == [8, 1, 2]               # [2, 3] matches, [1, 2, 3] does not
    assert draft([1, 2, 3], k=4) == []


def test_a_row_copying_its_prompt_needs_fewer_passes_than_tokens():
    prompt = [5, 6, 7, 8, 9, 4, 5]
    assert passes(prompt, [6, 7, 8, 9], k=4) == 1                       # all four drafted and accepted
    assert passes(prompt, [6, 7, 3, 9], k=4) == 2                       # [6, 7] accepted, 3 the model's own
    assert passes([1, 2, 3], [10, 11, 12], k=4) == 3                    # nothing to copy: one pass a token
