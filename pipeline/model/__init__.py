"""The model stage's library: a base model provisioned as a folder the runtime loads (`provision`),
and the named chat templates for model folders that ship none (`chat_templates`)."""
