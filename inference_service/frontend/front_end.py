"""The front end's door: each API's request in, the engine's `EngineRequest`s out.

Chat templates, tokenization, grammar compilation and validation run here, on a worker thread
(never on the event loop, never on the engine thread). The servicers in `api/` call one method per
route and hand what comes back to the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any, Protocol

from inference_service.errors import ModelLoadError
from inference_service.frontend import anthropic, images, openai, reasoning, tgi, tool_parsers
from inference_service.frontend.adapters import AdapterNames
from inference_service.frontend.anthropic import MessagesPlan
from inference_service.frontend.chat_images import ImageSource, collect_images
from inference_service.frontend.chat_template import ChatTemplate, load_template_file
from inference_service.frontend.images import LoadedImage, markdown_image_urls
from inference_service.frontend.openai import ChatPlan, CompletionPlan
from inference_service.frontend.parameters import GenerateRequest, TokenSpan
from inference_service.frontend.token_bytes import token_bytes_reader
from inference_service.frontend.validation import ValidatedRequest, Validator, tokenize
from inference_service.frontend.vision import VisionPrompts, check_image_count
from inference_service.outputs import EngineInfo
from inference_service.sample.grammar import GrammarCompiler
from inference_service.sampling_params import EngineRequest
from textgen.v1 import anthropic_pb2 as apb
from textgen.v1 import generate_pb2 as pb


class LoadedEngine(Protocol):
    """What the front end reads of a loaded engine (`AsyncEngine`, and the engine-core client)."""

    info: EngineInfo
    tokenizer: Any
    grammar_compiler: GrammarCompiler | None
    processor: Any  # a vision-language model's processor, else None
    adapters: Any  # the resident LoRA adapters' registry (its `names`), None when none are served


class FrontEnd:
    """Validates and converts requests for one loaded model (its tokenizer, limits and template)."""

    def __init__(
        self,
        info: EngineInfo,
        tokenizer: Any,
        grammar_compiler: GrammarCompiler | None = None,
        chat_template: str | None = None,
        rng: random.Random | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        processor: Any = None,
        adapters: AdapterNames | None = None,
    ):
        self.info = info
        self.adapters = adapters or AdapterNames(info.model_id)
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate(tokenizer, chat_template)
        # The model's own formats: named by the flags, else recognised in its chat template.
        self.reasoning = reasoning.reasoning_syntax(reasoning_parser, self.chat_template.source)
        self.tool_syntax = tool_parsers.tool_syntax(tool_call_parser, self.chat_template.source)
        self.token_bytes = token_bytes_reader(tokenizer)
        # A vision-language model's own processor (images → pixel values and placeholder tokens).
        self.vision = VisionPrompts(processor, info) if processor is not None and info.vision_architecture else None
        self.validator = Validator(
            tokenizer, info, rng=rng, grammar_compiler=grammar_compiler, vision=self.vision, adapters=self.adapters
        )
        self.has_fill_in_middle = openai.has_fill_in_middle(tokenizer)
        self._rng = rng or random.SystemRandom()

    @classmethod
    def for_engine(
        cls,
        engine: LoadedEngine,
        chat_template_file: str | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
    ) -> FrontEnd:
        """The front end of a loaded `AsyncEngine` (`--chat-template FILE` replaces the tokenizer's;
        the parsers are `--reasoning-parser` and `--tool-call-parser`, None to follow the template)."""
        template = None
        if chat_template_file:
            try:
                template = load_template_file(chat_template_file)
            except (OSError, ValueError) as error:
                raise ModelLoadError(f"--chat-template: {error}") from error
        registry = engine.adapters
        return cls(
            engine.info,
            engine.tokenizer,
            engine.grammar_compiler,
            template,
            reasoning_parser=reasoning_parser,
            tool_call_parser=tool_call_parser,
            processor=engine.processor,
            adapters=AdapterNames(engine.info.model_id, registry.names if registry is not None else None),
        )

    # -- TGI ------------------------------------------------------------------------------
    async def validate(self, request: GenerateRequest, *, stream: bool) -> ValidatedRequest:
        """TGI's validation, tokenization included."""
        return await asyncio.to_thread(self.validator.validate, request, stream=stream)

    async def generate(
        self, request: pb.GenerateRequest, *, stream: bool, compat_route: bool = False
    ) -> ValidatedRequest:
        converted = tgi.request_from_pb(request, compat_route=compat_route, pipeline_tag=self.info.pipeline_tag)
        if self.vision is not None and markdown_image_urls(converted.inputs):
            return await asyncio.to_thread(self._validate_with_images, converted, stream)
        return await self.validate(converted, stream=stream)

    def _validate_with_images(self, request: GenerateRequest, stream: bool) -> ValidatedRequest:
        """TGI's Markdown images `![](url)` in `inputs` (a text-only model reads them as text)."""
        request.images = self._load_images(markdown_image_urls(request.inputs))
        if self.vision is not None:
            request.inputs = self.vision.with_placeholders(request.inputs)
        return self.validator.validate(request, stream=stream)

    def _load_images(self, sources: Sequence[ImageSource]) -> list[LoadedImage]:
        """Fetched and decoded on this worker thread, after the count is checked (nothing is
        fetched for a request that is refused anyway)."""
        check_image_count(self.info, len(sources))
        max_size = self.info.max_image_fetch_size
        return [
            images.load_url(source, max_size)
            if isinstance(source, str)
            else images.decode(source, max_size, f"image {index} of the request")
            for index, source in enumerate(sources)
        ]

    def best_of_variants(self, validated: ValidatedRequest) -> list[EngineRequest]:
        """TGI's `best_of`: that many sequences, each freshly seeded (one request when 1)."""
        if validated.best_of <= 1:
            return [validated.engine_request]
        return [_reseeded(validated.engine_request, self._rng.getrandbits(64)) for _ in range(validated.best_of)]

    async def tokenize(self, inputs: str) -> list[TokenSpan]:
        return await asyncio.to_thread(tokenize, self.tokenizer, inputs)

    # -- OpenAI ---------------------------------------------------------------------------
    async def chat(self, request: pb.ChatCompletionRequest, *, stream: bool) -> tuple[ChatPlan, list[EngineRequest]]:
        """The conversation rendered by the chat template, validated; one request per choice."""
        plan = openai.chat_plan(request, self.tool_syntax, self.reasoning)
        plan.parameters.adapter_id = self.adapters.from_openai_model(request.model)
        plan.token_bytes = self.token_bytes
        return plan, await asyncio.to_thread(self._chat_choices, plan, request.HasField("seed"), stream)

    def _chat_choices(self, plan: ChatPlan, seed_requested: bool, stream: bool) -> list[EngineRequest]:
        messages, sources = collect_images(plan.messages)
        loaded = self._load_images(sources) if sources else []
        prompt = self.chat_template.render(
            messages,
            tools=plan.tools,
            documents=plan.documents,
            tool_prompt=plan.tool_prompt,
            variables=plan.template_variables,
            image_parts=bool(loaded),
        )
        if plan.reasoning is not None:  # the thoughts come first, free of any grammar
            plan.reasoning_inside = reasoning.starts_inside(plan.reasoning, prompt)
            if plan.parameters.grammar is not None and not reasoning.prompt_closed(plan.reasoning, prompt):
                plan.parameters.grammar = reasoning.grammar_after_thoughts(
                    plan.parameters.grammar, plan.reasoning, plan.reasoning_inside
                )
        generate = GenerateRequest(
            inputs=prompt, parameters=plan.parameters, add_special_tokens=False, strip_stop=True, images=loaded
        )  # the template already wrote the special tokens
        validated = self.validator.prepare(generate, do_sample=plan.do_sample, stream=stream)
        return self._choices(validated.engine_request, plan.num_choices, seed_requested)

    async def completion(self, request: pb.CompletionRequest) -> tuple[CompletionPlan, list[EngineRequest]]:
        """Each prompt validated; `n` requests per prompt, prompt by prompt. Unary and streamed
        alike: a stream sends the echoed prompt's logprobs in its first chunk (TGI's streams refuse
        `decoder_input_details`; OpenAI's have a place for them)."""
        plan = openai.completion_plan(request, has_fill_in_middle=self.has_fill_in_middle)
        plan.token_bytes = self.token_bytes
        plan.parameters.adapter_id = self.adapters.from_openai_model(request.model)
        return plan, await asyncio.to_thread(self._completion_choices, plan, request.HasField("seed"))

    def _completion_choices(self, plan: CompletionPlan, seed_requested: bool) -> list[EngineRequest]:
        choices = []
        for prompt in plan.prompts:
            generate = GenerateRequest(
                inputs=openai.with_suffix(prompt, plan.suffix), parameters=plan.parameters, strip_stop=True
            )
            validated = self.validator.prepare(generate, do_sample=plan.do_sample)
            choices += self._choices(validated.engine_request, plan.num_choices, seed_requested)
        return choices

    # -- Anthropic ------------------------------------------------------------------------
    async def messages(self, request: apb.MessagesRequest, *, stream: bool) -> tuple[MessagesPlan, list[EngineRequest]]:
        """Anthropic's Messages request, as the chat request it means: one engine request."""
        plan = anthropic.messages_plan(request, self.tool_syntax, self.reasoning)
        return plan, await asyncio.to_thread(self._chat_choices, plan.chat, False, stream)

    async def count_message_tokens(self, request: apb.MessagesRequest) -> int:
        """The prompt tokens of a Messages request as the template renders it (tools included)."""
        plan = anthropic.messages_plan(request, self.tool_syntax, self.reasoning, count_only=True)
        return await asyncio.to_thread(self._count_chat_prompt, plan.chat)

    def _count_chat_prompt(self, plan: ChatPlan) -> int:
        prompt = self.chat_template.render(
            plan.messages, tools=plan.tools, tool_prompt=plan.tool_prompt, variables=plan.template_variables
        )
        return len(self.tokenizer.encode(prompt, add_special_tokens=False))

    def _choices(self, request: EngineRequest, num_choices: int, seed_requested: bool) -> list[EngineRequest]:
        """`n` copies of a request, choice i seeded `seed + i` (or freshly when unseeded)."""
        seeds = openai.choice_seeds(
            request.sampling.seed, num_choices, seed_requested, lambda: self._rng.getrandbits(64)
        )
        return [request if i == 0 else _reseeded(request, seed) for i, seed in enumerate(seeds)]


def _reseeded(request: EngineRequest, seed: int) -> EngineRequest:
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))
