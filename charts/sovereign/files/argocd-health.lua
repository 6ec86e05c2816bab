-- Argo CD health check for sovereign.ai/LLMDeployment.
-- Runs in GopherLua (Lua 5.1) with the live object in the global `obj`; must return a table
-- with `status` (Healthy | Progressing | Degraded) and `message`. Without this check Argo CD
-- reports every custom resource Healthy the moment it exists.
local hs = {}

local function find_condition(conditions, wanted)
  if type(conditions) ~= "table" then
    return nil
  end
  for _, c in ipairs(conditions) do
    if type(c) == "table" and c.type == wanted then
      return c
    end
  end
  return nil
end

local function text(c, fallback)
  if c ~= nil then
    if c.message ~= nil and c.message ~= "" then
      return c.message
    end
    if c.reason ~= nil and c.reason ~= "" then
      return c.reason
    end
  end
  return fallback
end

local status = nil
if obj ~= nil then
  status = obj.status
end
if type(status) ~= "table" then
  hs.status = "Progressing"
  hs.message = "waiting for the operator"
  return hs
end

local conditions = status.conditions
local degraded = find_condition(conditions, "Degraded")
local ready = find_condition(conditions, "Ready")
local progressing = find_condition(conditions, "Progressing")

-- A status written for an older spec says nothing about the current one. The operator sets
-- status.observedGeneration; a Ready condition's own observedGeneration is the fallback.
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local observed = status.observedGeneration
if observed == nil and ready ~= nil then
  observed = ready.observedGeneration
end
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

-- Degraded wins: a deployment can be Ready on some replicas and still need attention.
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = text(degraded, "degraded")
  return hs
end
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = text(ready, "ready")
  return hs
end
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = text(progressing, "progressing")
  return hs
end
if ready ~= nil and ready.status == "False" and progressing ~= nil and progressing.status == "False" then
  -- Not ready and explicitly not making progress: the operator has given up waiting (crash
  -- loop, pods unschedulable past their budget, a failed startup).
  hs.status = "Degraded"
  hs.message = text(ready, "not ready")
  return hs
end

hs.status = "Progressing"
hs.message = text(ready, "waiting for the Ready condition")
return hs
