-- Argo CD health check for jobrunner.dev/BatchRun (docs/gitops.md embeds this file).
-- Succeeded -> Healthy; Pending/Running -> Progressing; Failed/Cancelled -> Degraded;
-- Suspended -> Suspended. A status the controller wrote for an older generation of the
-- spec is not a verdict yet (Progressing); a configuration problem it cannot retry past
-- (the database Secret missing or unreadable, an invalid spec) is Degraded.
local hs = {}
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the jobrunner controller"
  return hs
end

local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the controller to observe generation " .. tostring(generation)
  return hs
end

local conditions = {}
if status.conditions ~= nil then
  for _, c in ipairs(status.conditions) do
    conditions[c.type] = c
  end
end

local function message(default)
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return default
end

local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = message("all tasks done")
elseif phase == "Failed" or phase == "Cancelled" then
  hs.status = "Degraded"
  hs.message = message(phase)
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = message("suspended")
else
  -- Pending or Running
  local stalled = conditions["Stalled"]
  local enqueued = conditions["Enqueued"]
  if stalled ~= nil and stalled.status == "True" then
    hs.status = "Degraded"
    hs.message = stalled.message or message(phase)
  elseif enqueued ~= nil and enqueued.status == "False" and enqueued.reason ~= "WaitingForTasks"
      and enqueued.reason ~= "DatabaseUnavailable" then
    hs.status = "Degraded"
    hs.message = (enqueued.reason or "") .. ": " .. (enqueued.message or "")
  else
    hs.status = "Progressing"
    hs.message = message(phase)
  end
end
return hs
