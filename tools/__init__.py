"""Dev tools that run from a source checkout, not from the wheel: the GPU validation kit (`device_check`,
`device_common`, `device_nixl`, `nixl_wheel`), the planted-bug check (`plant_check`), the network lab and what
runs in it (`netlab`, `chaos_roles`, `soak`, the link benches `sharded_links` and `delta_links`).

    python -m tools.<name> --help     # from the repository root, with the package installed (./dev setup)

They import the library; the library never imports them.
"""
