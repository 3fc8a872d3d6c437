"""The evaluate stage's library: every decoding method on the held-out eval split, side by side
(`run`), and the extra figures at temperature > 0 (`sampling`)."""
