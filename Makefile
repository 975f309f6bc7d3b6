# Convenience wrappers around ./dev (which needs only Python and pip).
.PHONY: setup test demo grpo bench
setup:
	./dev setup
test:
	./dev test
demo:
	./dev demo
grpo:
	./dev grpo
bench:
	./dev setup && .venv/bin/lightning-weightsync bench
