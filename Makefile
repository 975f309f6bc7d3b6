# Convenience wrappers around ./dev (which needs only Python and pip).
.PHONY: setup test demo bench
setup:
	./dev setup
test:
	./dev test
demo:
	./dev demo
bench:
	./dev setup && .venv/bin/lightning-weightsync bench
