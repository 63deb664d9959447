-- _guards: the lifecycle and version checks of worker and operator writes (an include).

local function legal(old, new, actor)
  return string.find(LEGAL, ' ' .. old .. '>' .. new .. '#' .. actor .. ' ', 1, true) ~= nil
end

-- The fence-and-version check every worker write makes. The version the worker read must
-- still hold, except that a cancel request (the one write others make to a leased task)
-- is merged: it bumps the version once and records that version as cancel_version.
local function version_holds(current, cancel_version, read)
  if current == read then return true end
  return cancel_version ~= false and cancel_version ~= nil and current == cancel_version
         and tonumber(current) == (tonumber(read) or -2) + 1
end
