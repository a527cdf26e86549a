"""Test harness for kvlease's vLLM connector: vLLM engines driven the way
vLLM's engine core and model runners drive a KV connector, with real NIXL
agents, in processes. See ``engine.py`` (one engine), ``node.py`` (a process
hosting engines), ``cluster.py`` (the test-side controller)."""
