-- TGI's REST shapes on top of Envoy's gRPC-JSON transcoder.
--
-- The transcoder prints each response as proto3 JSON (field names preserved, zero values printed,
-- fields in field-number order, compact). This filter sits before it in the chain, so it sees the
-- request before the transcoder and the transcoded response after it, and turns that JSON into
-- TGI's:
--   * 64-bit integers (`seed`, `num_steps`, `weights_memory_bytes`) are strings in proto3 JSON: printed as numbers;
--   * NaN/Infinity floats (the first prompt token's logprob) are strings: printed as null;
--   * `top_tokens` is a list of lists in TGI (`repeated TopTokens{tokens}` in the proto);
--   * `top_tokens`/`best_of_sequences` are left out when empty, `seed` is null when absent,
--     stream events carry `generated_text`/`details` as null until the last one;
--   * a route's `unwrap` field is the proto's `response_body` (Envoy applies it to HttpBody only):
--     `{"responses":[...]}` becomes `[...]`;
--   * failed calls become `{"error": ..., "error_type": ...}` with TGI's status codes, and on a
--     stream an in-band SSE event (TGI answers 200 once a stream route is reached);
--   * `POST /` (and SageMaker's `POST /invocations`) with `"stream": true` is routed to
--     GenerateStream (Envoy can't route on a body), and OpenAI's `POST /v1/chat/completions` and
--     `/v1/completions` to their stream RPCs;
--   * OpenAI's routes get OpenAI's JSON, SSE chunks ending in `data: [DONE]` and error objects;
--   * Anthropic's routes get Anthropic's JSON, SSE events named by `event:` lines and error objects,
--     and `POST /v1/messages` with `"stream": true` goes to MessagesStream;
--     `GET /` and `GET /ping` are /health; OPTIONS requests never reach the server.
--
-- Why rewriting text is safe: the patterns below all contain a quote followed by `:` or a quote
-- preceded by `:`; inside a JSON string every quote is escaped (`\"`), so such a pattern can only
-- match the JSON structure, never the text of a prompt or a token.
--
-- Routes tell the filter what they hold through route metadata: `kind` ("json", "stream",
-- "health", "raw", "openai", "openai_stream", "anthropic", "anthropic_stream",
-- "openai_response", "openai_response_stream"), `unwrap` (a field name) and `nulls` (top-level fields TGI prints as null, comma
-- separated).

-- Kept equal to the proto's 64-bit integer and float response fields by a unit test.
local INT64_FIELDS = {"seed", "num_steps", "weights_memory_bytes"}
local FLOAT_FIELDS = {"logprob", "waiting_served_ratio", "temperature", "top_p"}
-- Repeated fields TGI leaves out when empty (the transcoder prints `[]`).
local OMIT_WHEN_EMPTY = {"top_tokens", "best_of_sequences"}

-- Error kinds of the server (google.rpc.ErrorInfo reason, `x-error-type`) -> TGI's HTTP status.
-- A client only sees `cancelled` when the server cancelled (shutting down): 503, as `unavailable`.
local ERROR_STATUS = {
  validation = 422, overloaded = 429, generation = 424, unavailable = 503, cancelled = 503,
  internal = 500, unauthorized = 401, template_error = 422, tool_error = 422, not_found = 404,
}
-- gRPC codes, for errors that did not come with an `x-error-type` (grpc's own, a proxy's).
local GRPC_CODE_NAMES = {
  "cancelled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
  "permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
  "unimplemented", "internal", "unavailable", "data_loss", "unauthenticated",
}
local GRPC_HEADERS = {"grpc-status", "grpc-message", "grpc-status-details-bin", "grpc-accept-encoding",
                      "x-error-type"}

-- JSON -----------------------------------------------------------------------------------------
local ESCAPES = {['"'] = '\\"', ['\\'] = '\\\\', ['\n'] = '\\n', ['\r'] = '\\r', ['\t'] = '\\t'}

local function json_string(text)
  local escaped = text:gsub('[%c"\\]', function(char)
    return ESCAPES[char] or string.format("\\u%04x", char:byte())
  end)
  return '"' .. escaped .. '"'
end

local function error_json(message, error_type)
  return '{"error":' .. json_string(message) .. ',"error_type":' .. json_string(error_type) .. '}'
end

-- The index just past the JSON string that starts at `start` (a quote).
local function string_end(text, start)
  local at = start + 1
  while true do
    local found = text:find('["\\]', at)
    if found == nil then return #text + 1 end
    if text:byte(found) == 92 then at = found + 2 else return found + 1 end
  end
end

-- `"top_tokens":[{"tokens":[a,b]},{"tokens":[]}]` -> `"top_tokens":[[a,b],[]]`. Token objects hold
-- no arrays, so inside an element the first `]` outside a string closes its `tokens`.
local WRAPPED = '"top_tokens":[{"tokens":['
local ELEMENT = '{"tokens":['

local function flatten_top_tokens(text)
  if not text:find(WRAPPED, 1, true) then return text end
  local parts, pos = {}, 1
  while true do
    local start = text:find(WRAPPED, pos, true)
    if start == nil then break end
    parts[#parts + 1] = text:sub(pos, start + #'"top_tokens":[' - 1)
    local at = start + #'"top_tokens":['
    while text:sub(at, at + #ELEMENT - 1) == ELEMENT do
      parts[#parts + 1] = "["
      local from = at + #ELEMENT
      at = from
      while true do
        local found = text:find('["%]]', at)
        if found == nil then return text end  -- not the printer's output: leave it as it is
        if text:byte(found) == 34 then at = string_end(text, found) else at = found; break end
      end
      parts[#parts + 1] = text:sub(from, at)  -- the tokens and their `]`
      at = at + 2  -- past `]}`
      if text:sub(at, at) == "," then parts[#parts + 1] = ","; at = at + 1 end
    end
    pos = at
  end
  parts[#parts + 1] = text:sub(pos)
  return table.concat(parts)
end

-- Proto3 JSON of a response -> TGI's JSON.
local function tgi_json(text)
  for _, name in ipairs(INT64_FIELDS) do
    text = text:gsub('"' .. name .. '":"(%-?%d+)"', '"' .. name .. '":%1')
  end
  for _, name in ipairs(FLOAT_FIELDS) do
    text = text:gsub('"' .. name .. '":"%-?%a+"', '"' .. name .. '":null')
  end
  text = flatten_top_tokens(text)
  for _, name in ipairs(OMIT_WHEN_EMPTY) do
    text = text:gsub(',"' .. name .. '":%[%]', "")
  end
  -- `seed` follows `generated_tokens` in Details, BestOfSequence and StreamDetails.
  text = text:gsub('("generated_tokens":%d+),"prefill"', '%1,"seed":null,"prefill"')
  text = text:gsub('("generated_tokens":%d+),"input_length"', '%1,"seed":null,"input_length"')
  return text
end

-- Add `"name":null` for each absent top-level field of an object.
local function with_nulls(text, names)
  local added = {}
  for name in names:gmatch("[^,]+") do
    if not text:find('"' .. name .. '":', 1, true) then added[#added + 1] = '"' .. name .. '":null' end
  end
  if #added == 0 then return text end
  local sep = text == "{}" and "" or ","
  return text:sub(1, -2) .. sep .. table.concat(added, ",") .. "}"
end

-- `{"responses":[...]}` -> `[...]` (the printer writes the single field as the whole object).
local function unwrap(text, field)
  local head = '{"' .. field .. '":'
  if text:sub(1, #head) == head then return text:sub(#head + 1, -2) end
  return "[]"  -- the printer leaves an empty repeated field out only when primitives are off
end

-- Streams ---------------------------------------------------------------------------------------
local function strip_grpc_headers(headers)
  for _, name in ipairs(GRPC_HEADERS) do headers:remove(name) end
end

local STREAM_NULLS = "generated_text,details"

-- The server's heartbeat on an idle stream (`keep_alive`, asked for by the route): TGI's comment.
local KEEPALIVE_EVENT = '"keep_alive":true'
local KEEPALIVE_COMMENT = ":\n\n"

local function tgi_event(json)
  json = tgi_json(json)
  local error_at = json:find(',"error":"', 1, true)
  if error_at ~= nil then return "{" .. json:sub(error_at + 1) end
  return with_nulls(json, STREAM_NULLS)
end

local function tgi_sse_event(json)
  if json:find(KEEPALIVE_EVENT, 1, true) then return KEEPALIVE_COMMENT end
  return "data: " .. tgi_event(json) .. "\n\n"
end

-- Events arrive whole (the transcoder prints one per gRPC message); a partial one waits anyway.
local function shape_stream(handle, shape_event)
  local pending = ""
  for chunk in handle:bodyChunks() do
    local text = pending
    if chunk:length() > 0 then text = text .. chunk:getBytes(0, chunk:length()) end
    local whole, rest = text:match("^(.*\n\n)(.*)$")
    if whole == nil then whole, rest = "", text end
    pending = rest
    chunk:setBytes((whole:gsub("data: ([^\n]*)\n\n", shape_event)))
  end
  local trailers = handle:trailers()  -- HTTP/2 clients would see the gRPC status otherwise
  if trailers ~= nil then strip_grpc_headers(trailers) end
end

-- OpenAI -------------------------------------------------------------------------------------
-- OpenAI's routes print OpenAI's JSON: proto3 JSON leaves unset fields out, and these rules put
-- OpenAI's nulls back by the fields around them (the proto orders them so: a choice is index,
-- finish_reason, logprobs, then message / delta / text), and drop empty `tool_calls`.
local OPENAI_KINDS = {openai = true, openai_stream = true, openai_response = true, openai_response_stream = true}
local OPENAI_NULLS = {
  {'("index":%d+),"logprobs":', '%1,"finish_reason":null,"logprobs":'},
  {'("index":%d+),"delta":', '%1,"finish_reason":null,"logprobs":null,"delta":'},
  {'("index":%d+),"text":', '%1,"finish_reason":null,"logprobs":null,"text":'},
  {'("finish_reason":"[%w_]*"),"message":', '%1,"logprobs":null,"message":'},
  {'("finish_reason":"[%w_]*"),"delta":', '%1,"logprobs":null,"delta":'},
  {'("finish_reason":"[%w_]*"),"text":', '%1,"logprobs":null,"text":'},
  {'("role":"assistant"),"tool_calls":%[{', '%1,"content":null,"tool_calls":[{'},
  {'("role":"assistant"),"reasoning_content":', '%1,"content":null,"reasoning_content":'},
}
-- Error kinds -> OpenAI's HTTP status (what its SDK turns into typed exceptions) and error type.
local OPENAI_ERROR_STATUS = {
  validation = 400, template_error = 422, tool_error = 422, not_found = 404, unauthorized = 401,
  overloaded = 429, generation = 500, internal = 500, unavailable = 503, cancelled = 503,
}
local OPENAI_ERROR_TYPE = {[401] = "authentication_error", [404] = "invalid_request_error",
                           [429] = "rate_limit_error", [500] = "server_error", [503] = "server_error"}

local function openai_error_json(message_json, code, status)
  local error_type = OPENAI_ERROR_TYPE[status] or (status < 500 and "invalid_request_error" or "server_error")
  return '{"error":{"message":' .. message_json .. ',"type":' .. json_string(error_type) ..
         ',"param":null,"code":' .. json_string(code) .. '}}'
end

local function openai_json(text)
  text = text:gsub(',"tool_calls":%[%]', ""):gsub('{"tool_calls":%[%]}', "{}")
  for _, rule in ipairs(OPENAI_NULLS) do text = text:gsub(rule[1], rule[2]) end
  return text
end

-- The server's last chunk (`done`), heartbeat and in-band error, as OpenAI's SSE stream has them.
local function openai_event(json)
  if json:find('"done":true', 1, true) then return "data: [DONE]\n\n" end
  if json:find(KEEPALIVE_EVENT, 1, true) then return KEEPALIVE_COMMENT end
  local message = json:match(',"error":{"message":(".-"),"type":')
  if message ~= nil then
    local code = json:match('"code":"([%w_]*)"') or "internal"
    return "data: " .. openai_error_json(message, code, OPENAI_ERROR_STATUS[code] or 500) .. "\n\n"
  end
  return "data: " .. openai_json(json) .. "\n\n"
end

-- Responses API: an output item is one message whose `type` says which fields it uses; the empty
-- lists of the others are dropped (a message keeps its `content`, `[]` while in progress), and a
-- reasoning item's `reasoning_content` is OpenAI's `content`.
local RESPONSE_RULES = {
  {'("type":"reasoning","id":"[%w_]*","status":"[%w_]*"),"content":%[%],"summary":%[%],"reasoning_content":',
   '%1,"summary":[],"content":'},
  {'("type":"function_call","id":"[%w_]*","status":"[%w_]*"),"content":%[%]', '%1'},
  {',"summary":%[%],"reasoning_content":%[%]', ''},
}

local function response_json(text)
  for _, rule in ipairs(RESPONSE_RULES) do text = text:gsub(rule[1], rule[2]) end
  return text
end

-- Responses' SSE: each event named by its `type` (the first field), heartbeats as comments.
local function response_event(json)
  if json:find(KEEPALIVE_EVENT, 1, true) then return KEEPALIVE_COMMENT end
  local event_type = json:match('^{"type":"([%w_.]+)"') or "message"
  return "event: " .. event_type .. "\ndata: " .. response_json(json) .. "\n\n"
end

-- Anthropic ----------------------------------------------------------------------------------
-- Anthropic's routes: proto3 JSON leaves an unset `stop_reason`/`stop_sequence` out, and these rules
-- put Anthropic's nulls back by the fields around them (a message is ..., content, stop_reason,
-- stop_sequence, usage; a message_delta's delta ends with them).
local ANTHROPIC_KINDS = {anthropic = true, anthropic_stream = true}
local ANTHROPIC_NULLS = {
  {'"content":%[%],"usage":', '"content":[],"stop_reason":null,"stop_sequence":null,"usage":'},
  {'("stop_reason":"[%w_]*"),"usage":', '%1,"stop_sequence":null,"usage":'},
  {'("stop_reason":"[%w_]*")}', '%1,"stop_sequence":null}'},
}
-- Error kinds (and gRPC codes of errors without one) -> Anthropic's HTTP status and error type.
local ANTHROPIC_ERROR_STATUS = {
  validation = 400, template_error = 400, tool_error = 400, invalid_argument = 400, not_found = 404,
  unauthorized = 401, unauthenticated = 401, overloaded = 429, resource_exhausted = 429, generation = 500,
  internal = 500, unavailable = 503, cancelled = 503,
}
local ANTHROPIC_ERROR_TYPE = {[400] = "invalid_request_error", [401] = "authentication_error",
                              [403] = "permission_error", [404] = "not_found_error", [413] = "request_too_large",
                              [415] = "invalid_request_error", [429] = "rate_limit_error",
                              [503] = "overloaded_error", [529] = "overloaded_error"}

local function anthropic_error_json(message_json, status)
  local error_type = ANTHROPIC_ERROR_TYPE[status] or (status < 500 and "invalid_request_error" or "api_error")
  return '{"type":"error","error":{"type":' .. json_string(error_type) .. ',"message":' .. message_json .. '}}'
end

local function anthropic_json(text)
  for _, rule in ipairs(ANTHROPIC_NULLS) do text = text:gsub(rule[1], rule[2]) end
  return text
end

-- Each event under its SSE name (the event's `type`, printed first); errors come ready-made.
local function anthropic_event(json)
  local name = json:match('^{"type":"([%w_]+)"') or "message"
  return "event: " .. name .. "\ndata: " .. anthropic_json(json) .. "\n\n"
end

-- Errors ----------------------------------------------------------------------------------------
local function percent_decoded(text)
  return (text:gsub("%%(%x%x)", function(hex) return string.char(tonumber(hex, 16)) end))
end

-- A call that failed before any message (a trailers-only gRPC response). Handles and wrappers
-- are fetched again after `body()`: it may yield, which ends the scope of older ones.
local function shape_grpc_error(handle, kind, grpc_status)
  local headers = handle:headers()
  local error_type = headers:get("x-error-type") or GRPC_CODE_NAMES[tonumber(grpc_status)] or "unknown"
  local message = percent_decoded(headers:get("grpc-message") or "")
  local status = ERROR_STATUS[error_type] or tonumber(headers:get(":status")) or 500
  local body, content_type = error_json(message, error_type), "application/json"
  if OPENAI_KINDS[kind] then  -- OpenAI's status codes and error object, streams included
    status = OPENAI_ERROR_STATUS[error_type] or status
    body = openai_error_json(json_string(message), error_type, status)
  elseif ANTHROPIC_KINDS[kind] then  -- Anthropic's status codes and error object, streams included
    status = ANTHROPIC_ERROR_STATUS[error_type] or status
    body = anthropic_error_json(json_string(message), status)
  elseif status == 401 then  -- TGI's auth layer answers before any route: a bare 401, streams included
    body, content_type = "", nil
  elseif kind == "stream" then  -- TGI: 200 and the error as the stream's only event
    body, content_type, status = "data: " .. body .. "\n\n", "text/event-stream", 200
  elseif kind == "health" then
    body, status = error_json("unhealthy", "healthcheck"), 503
  end
  handle:body(true):setBytes(body)
  headers = handle:headers()
  strip_grpc_headers(headers)
  headers:replace(":status", tostring(status))
  if content_type == nil then headers:remove("content-type") else headers:replace("content-type", content_type) end
end

-- Entry points ----------------------------------------------------------------------------------
-- Whether the request's top-level object has `"stream": true` (a prompt mentioning it does not count).
-- The walk runs on Envoy's worker thread, which every connection shares: a body without the text is
-- answered by one search in C, and the walk stops past the nesting the transcoder's JSON parser takes
-- (such a body is refused there whatever its flag). A body nested 400,000 deep held the worker for
-- tens of ms, and every other request through Envoy with it.
local MAX_JSON_DEPTH = 100  -- protobuf's JSON parser's recursion limit
local function wants_stream(text)
  if not text:find('"stream"%s*:%s*true') then return false end
  local depth, at = 0, 1
  while true do
    local found = text:find('["{}%[%]]', at)
    if found == nil then return false end
    local char = text:sub(found, found)
    if char == '"' then
      at = string_end(text, found)
      if depth == 1 and text:sub(found, at - 1) == '"stream"' and text:find("^%s*:%s*true", at) then
        return true
      end
    else
      depth = depth + ((char == "{" or char == "[") and 1 or -1)
      if depth > MAX_JSON_DEPTH then return false end
      at = found + 1
    end
  end
end

local OPENAI_STREAMABLE = {["/v1/chat/completions"] = true, ["/v1/completions"] = true, ["/v1/messages"] = true,
                          ["/v1/responses"] = true}

-- Prefix routing (`launch --routing prefix`; the config sets PREFIX_ROUTING before this source):
-- the generation routes get a header hashing the first PREFIX_BYTES bytes of the prompt (TGI's
-- `inputs`, OpenAI's `messages` or `prompt`, as JSON text), which Envoy's ring hash maps to a replica.
local GENERATION_PATHS = {["/"] = true, ["/generate"] = true, ["/generate_stream"] = true, ["/invocations"] = true,
                          ["/v1/chat/completions"] = true, ["/v1/completions"] = true, ["/v1/messages"] = true,
                          ["/v1/responses"] = true}
local PREFIX_BYTES = 256

local function prefix_hash(text)
  local _, value_at = text:find('"inputs"%s*:%s*')
  if value_at == nil then _, value_at = text:find('"messages"%s*:%s*') end
  if value_at == nil then _, value_at = text:find('"prompt"%s*:%s*') end
  if value_at == nil then _, value_at = text:find('"input"%s*:%s*') end
  if value_at == nil then return nil end
  local hash = 0
  for i = value_at + 1, math.min(#text, value_at + PREFIX_BYTES) do
    hash = (hash * 31 + text:byte(i)) % 2147483647  -- exact in a double: no bit operations needed
  end
  return string.format("%x", hash)
end

local function set_prefix_hash(handle, path)
  if not (PREFIX_ROUTING and GENERATION_PATHS[path]) then return end
  local body = handle:body()
  if body == nil then return end
  local hash = prefix_hash(body:getBytes(0, body:length()))
  if hash ~= nil then handle:headers():replace("x-prefix-hash", hash) end
end

-- gRPC's content type on a REST route would pass the transcoder untouched and reach the engine as
-- a gRPC call to no method (a reset, which read as "unreachable"): 415 at once, saying what to send.
-- Envoy answers a gRPC request in gRPC's shape, so the request is marked and the answer rewritten.
local WRONG_CONTENT_TYPE = "Unsupported Media Type: this route takes JSON (Content-Type: application/json); " ..
                           "application/grpc is for gRPC calls, which go to /textgen.v1.TextGeneration/<method>"
-- gRPC's content type over HTTP/1 (no gRPC client sends that, and its answer cannot carry trailers)
-- reached the engine as bytes that are no gRPC frame: a reset, read as "unreachable" too.
local GRPC_NEEDS_HTTP2 = "Unsupported Media Type: gRPC calls need HTTP/2; the REST routes take JSON " ..
                         "(Content-Type: application/json)"
local LUA_FILTER = "envoy.filters.http.lua"

local function over_http1(handle)
  local protocol = handle:streamInfo():protocol()
  return protocol ~= nil and protocol:find("^HTTP/1") ~= nil
end

local function refuse_grpc_content_type(handle, message)
  handle:streamInfo():dynamicMetadata():set(LUA_FILTER, "wrong_content_type", message)
  handle:respond({[":status"] = "415"}, message)
end

local function wrong_content_type_answer(handle, kind, message)
  local body = error_json(message, "validation")
  if OPENAI_KINDS[kind] then body = openai_error_json(json_string(message), "validation", 415) end
  if ANTHROPIC_KINDS[kind] then body = anthropic_error_json(json_string(message), 415) end
  handle:body(true):setBytes(body)
  local headers = handle:headers()
  strip_grpc_headers(headers)
  headers:replace(":status", "415")
  headers:replace("content-type", "application/json")
end

function envoy_on_request(handle)
  local headers = handle:headers()
  local method, path = headers:get(":method"), (headers:get(":path") or ""):match("^[^?]*")
  local content_type = headers:get("content-type")
  if content_type ~= nil and content_type:lower():find("^application/grpc") then
    if handle:metadata():get("kind") then
      refuse_grpc_content_type(handle, WRONG_CONTENT_TYPE)
      return
    elseif over_http1(handle) then
      refuse_grpc_content_type(handle, GRPC_NEEDS_HTTP2)
      return
    end
  end
  if method == "OPTIONS" then  -- a preflight the cors filter did not answer: not an allowed origin
    handle:respond({[":status"] = "200"}, "")
    return
  end
  if method == "POST" then set_prefix_hash(handle, path) end
  if OPENAI_STREAMABLE[path] and method == "POST" then  -- the stream RPC is bound to <path>/stream
    local body = handle:body()
    if body ~= nil and wants_stream(body:getBytes(0, body:length())) then
      handle:headers():replace(":path", path .. "/stream")
      handle:clearRouteCache()
    end
    return
  end
  if path ~= "/" and path ~= "/ping" and path ~= "/invocations" then return end
  if method == "GET" and path ~= "/invocations" then  -- TGI's health aliases
    handle:headers():replace(":path", "/health")
    handle:clearRouteCache()
  elseif method == "POST" and (path == "/" or path == "/invocations") then
    local body = handle:body()
    if body ~= nil and wants_stream(body:getBytes(0, body:length())) then
      handle:headers():replace(":path", "/generate_stream")
      handle:clearRouteCache()
    end
  end
end

function envoy_on_response(handle)
  local metadata = handle:metadata()
  local kind, field, nulls = metadata:get("kind"), metadata:get("unwrap"), metadata:get("nulls")
  local marks = handle:streamInfo():dynamicMetadata():get(LUA_FILTER)
  if marks ~= nil and marks.wrong_content_type then
    return wrong_content_type_answer(handle, kind, marks.wrong_content_type)
  end
  if kind == nil then return end  -- not a transcoded route (404, 405)
  local headers = handle:headers()
  local grpc_status = headers:get("grpc-status")
  if grpc_status ~= nil and grpc_status ~= "0" then return shape_grpc_error(handle, kind, grpc_status) end
  strip_grpc_headers(headers)
  if headers:get(":status") ~= "200" then  -- Envoy's own reply (server unreachable), already JSON
    if kind == "health" then
      handle:body(true):setBytes(error_json("unhealthy", "healthcheck"))
      handle:headers():replace("content-type", "application/json")
    end
    return
  end
  if kind == "stream" then return shape_stream(handle, tgi_sse_event) end
  if kind == "openai_stream" then return shape_stream(handle, openai_event) end
  if kind == "openai_response_stream" then return shape_stream(handle, response_event) end
  if kind == "anthropic_stream" then return shape_stream(handle, anthropic_event) end
  if kind ~= "json" and kind ~= "openai" and kind ~= "openai_response" and kind ~= "anthropic" then return end
  local body = handle:body()
  if body == nil then return end
  local text = body:getBytes(0, body:length())
  if kind == "openai_response" then
    body:setBytes(response_json(text))
    return
  end
  if kind == "openai" then
    body:setBytes(openai_json(text))
    return
  end
  if kind == "anthropic" then
    body:setBytes(anthropic_json(text))
    return
  end
  text = tgi_json(text)
  if field ~= nil then text = unwrap(text, field) end
  if nulls ~= nil then text = with_nulls(text, nulls) end
  body:setBytes(text)
end
