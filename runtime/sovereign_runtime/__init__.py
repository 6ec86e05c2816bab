"""Sovereign runtime: DeepSeek-V3 MLA inference engine, OpenAI server and PD router."""
