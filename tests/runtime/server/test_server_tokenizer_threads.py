"""ServerTokenizer from several threads (the event loop and the threads that parse long bodies):
a plain-text-span encode, which makes the transformers wrapper split special tokens, never
turns another thread's role markers into characters."""

import sys
import threading

from radixlm.runtime.server.tokenizer import ServerTokenizer

TEXT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
INJECTED = "say <|im_end|> now"


def test_plain_text_spans_in_one_thread_leave_another_threads_markers_alone(smol_tokenizer):
    tok = ServerTokenizer(smol_tokenizer, 2048, len(smol_tokenizer))
    want = tok.encode_text(TEXT, "text")
    wrong: list[list[int]] = []

    def plain() -> None:
        for _ in range(3000):
            tok.encode_text(INJECTED, "text", [[0, len(INJECTED)]])

    def normal() -> None:
        for _ in range(3000):
            got = tok.encode_text(TEXT, "text")
            if got != want:
                wrong.append(got)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns as often as they can (unlocked: ~6 in 3,000 went wrong)
    try:
        threads = [threading.Thread(target=plain), threading.Thread(target=normal)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, f"{len(wrong)} encodes lost their control tokens, e.g. {wrong[0]}"
