"""Binds the plugin in the tokenizer process that imports it (see the
package), as SGLang's plugin loader would: ``register()``, then SGLang's
``HookRegistry.apply_hooks()``. Where the plugin is bound already (the
launcher, whose tokenizer imports this too), nothing changes."""

from __future__ import annotations

from .. import plugin

__all__: list[str] = []

if not plugin.bound:
    plugin.register()
    if plugin.bound:
        from sglang.srt.plugins.hook_registry import HookRegistry

        HookRegistry.apply_hooks()
