"""OpenAI's Responses API (/v1/responses): input items over the chat path, responses stored with their
conversation's token ids, so that a follow-up (previous_response_id) appends only its new tokens."""
