"""The plugin in SGLang's HTTP tokenizer workers (``--tokenizer-worker-num``
above 1), which SGLang starts without loading plugins. Each tokenizer
process imports every module of the package named by
``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE`` (it looks there for multimodal
processors); the plugin names this package there in the launcher, where
the variable is unset, and the workers inherit it. Its one module binds
the plugin (:mod:`.bind`); it defines no processor, so SGLang's stay."""
