"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the same chat path as
OpenAI's chat completions: its request made into a ChatInput, its replies in Anthropic's shapes."""
