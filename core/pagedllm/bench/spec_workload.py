"""Input-grounded prompts for speculative decoding benchmarks: "repeat / edit this passage" chat requests, where
much of the answer is copied from the prompt (what n-gram / prompt-lookup speculation is for)."""

from __future__ import annotations

from typing import Any

PASSAGES = [
    "The river rises in the northern hills and flows south through a wide valley of farms and small towns. In spring "
    "the snow melts and the water runs fast and cold, carrying branches and stones toward the sea. Fishermen wait "
    "for the summer, when the current slows and the trout come back to the deep pools below the old stone bridge.",
    "To install the package, first create a virtual environment and activate it. Then run the installer with the "
    "default options and wait until it finishes. If the installer reports a missing library, install that library "
    "with your system package manager and run the installer again. Finally, check the version number to confirm "
    "that the installation worked.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase spending on public libraries and to reduce the cost of maintaining the city parks. The "
    "final vote was seven to two, and the new budget will take effect on the first day of January.",
    "Our cat sleeps most of the day on the warm windowsill in the kitchen. In the evening she wakes up, stretches "
    "slowly, and walks to her bowl to see whether dinner has arrived. If the bowl is empty, she sits next to it and "
    "stares at whoever is closest until someone finally gets up and feeds her.",
]

INSTRUCTIONS = [
    "Repeat the following passage exactly, word for word:\n\n{p}",
    "Rewrite the following passage, changing every past tense verb to present tense where possible and keeping "
    "everything else the same:\n\n{p}",
]


def repeat_prompts(tokenizer: Any, num: int) -> list[dict]:
    """``num`` chat prompts cycling over passages x instructions (token ids, chat template applied)."""
    out = []
    for i in range(num):
        text = INSTRUCTIONS[(i // len(PASSAGES)) % len(INSTRUCTIONS)].format(p=PASSAGES[i % len(PASSAGES)])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)
        out.append({"prompt_token_ids": list(ids)})
    return out
