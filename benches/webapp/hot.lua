-- wrk: each connection alternates the service's two hot routes, the cached report
-- (get_or_set_with) and the cached page (the response-cache layer).
local paths = { "/report/1", "/page/1" }
local n = 0

request = function()
    n = n + 1
    return wrk.format("GET", paths[n % 2 + 1])
end
