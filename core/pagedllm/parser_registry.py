"""One registry of parser classes by name, the shape vLLM's ``ToolParserManager`` and ``ReasoningParserManager``
share: ``register_module`` (a class decorator, or a call with ``module=``), ``register_lazy_module`` (a class imported
on first use) and lookup by name, with errors naming what is registered."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar, Optional, Union


class ParserRegistry:
    """A subclass sets ``kind`` (the words in errors), ``base`` (what a registered class must subclass) and its own
    ``parsers`` / ``lazy_parsers`` dicts."""

    kind: ClassVar[str]
    base: ClassVar[type]
    parsers: ClassVar[dict[str, type]]
    lazy_parsers: ClassVar[dict[str, tuple[str, str]]]

    @classmethod
    def get(cls, name: str) -> type:
        """The class registered as ``name``; KeyError naming the registered ones otherwise."""
        if name in cls.parsers:
            return cls.parsers[name]
        if name in cls.lazy_parsers:
            module_path, class_name = cls.lazy_parsers[name]
            cls.parsers[name] = cls._checked(getattr(importlib.import_module(module_path), class_name))
            return cls.parsers[name]
        raise KeyError(f"{cls.kind} {name!r} not found; registered: {', '.join(cls.list_registered())}")

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.parsers) | set(cls.lazy_parsers))

    @classmethod
    def register_lazy_module(cls, name: str, module_path: str, class_name: str) -> None:
        cls.lazy_parsers[name] = (module_path, class_name)

    @classmethod
    def register_module(cls, name: Union[str, list[str], None] = None, force: bool = True,
                        module: Optional[type] = None) -> Any:
        """Register ``module`` under ``name`` (a name or a list; default the class name); without ``module``, a
        class decorator. ``force=False`` refuses a name already taken."""
        def register(obj: type) -> type:
            cls._checked(obj)
            for n in [obj.__name__] if name is None else [name] if isinstance(name, str) else list(name):
                if not force and n in cls.parsers:
                    raise KeyError(f"{cls.kind} {n!r} is already registered ({cls.parsers[n].__module__})")
                cls.parsers[n] = obj
            return obj

        return register if module is None else register(module)

    @classmethod
    def _checked(cls, obj: Any) -> type:
        if not (isinstance(obj, type) and issubclass(obj, cls.base)):
            raise TypeError(f"a {cls.kind} must be a subclass of {cls.base.__name__}, got {obj!r}")
        return obj
