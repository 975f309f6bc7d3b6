"""Examples that run from a source checkout (the recipes in recipes/ call them): the GRPO loop (`grpo`) and the
Qwen3 trainer pieces (`qwen3`). They import the library; the library never imports them. The demo's tiny LM and
the recipes' one `main()` ship with the package (`lightning_weightsync.demo`)."""
